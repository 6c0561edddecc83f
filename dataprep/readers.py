"""Readers: raw interaction files -> one columnar table of (user, item, time) events.

Formats (pyarrow only on the hot path):
  sasrec     one `user item` pair per line, oldest first (kang205/SASRec data)
  iclrec     one line per user, `user item item ...`, oldest first (salesforce/ICLRec data)
  movielens  ratings.dat (`user::item::rating::timestamp`) or ratings.csv (with header)
  events     Parquet (file or folder) or CSV with user, item and timestamp columns

Whitespace formats are parsed by pyarrow's CSV reader when every line is clean;
on any parse error the reader falls back to a line-by-line tokenizer that rejects
only the bad lines, each with its 1-based line number and a reason. Ids there are
integers 0 .. 2**63-1 (others: negative_id, non_integer_id, id_out_of_range); a
movielens .dat timestamp is an integer (else bad_timestamp).

CSV events (and movielens ratings.csv) are read as strings and typed here, so one bad
row costs that row: wrong field count (malformed_line), bytes that are not UTF-8
(not_utf8), an empty value (missing_value), a time not of the column's kind
(bad_timestamp; see _parse_times: epoch integers, epoch seconds with a fraction, or
ISO-8601). Ids are int64 when every id of the column is one, else opaque strings, so
an id above int64 is kept exactly (Parquet uint64 too). Parquet: typed columns are
used as they are; a string time column is parsed like CSV's, row by row; a time column
of another type, or a file pyarrow cannot read, is an error naming file and column.

Bad rows become rejects; problems with a whole file (missing, empty, missing
column, not readable) raise DataprepError naming the file and what to do.
"""

import csv
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.dataset as pds

from dataprep.errors import DataprepError
from dataprep.schema import REJECTS_SCHEMA

FORMATS = ("sasrec", "iclrec", "movielens", "events")
TIME_FORMATS = ("movielens", "events")  # real event times; the others order by input position
_INT_TOKEN = r"^[0-9]{1,18}$"  # fits int64 (19 digits are checked against _INT64_MAX; more: id_out_of_range)
_INT64_MAX = str(2**63 - 1)
_NEG_TOKEN = r"^-[0-9]+$"


@dataclass
class Interactions:
    """Events in input order. `ts` orders a user's events (stable on ties);
    for formats without timestamps it is the event's position in the input."""

    user: pa.Array  # raw user ids: int64, or string for events with string ids
    item: pa.Array  # raw item ids: same rule
    ts: np.ndarray  # int64
    source: np.ndarray  # int32 index into `paths`
    line: np.ndarray  # int64 1-based line (text) or row (Parquet) number
    paths: list[str]
    has_time: bool  # real timestamps (ties and duplicates possible) vs input order
    rejects: list[pa.Table] = field(default_factory=list)
    counts: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.user)


def _reject_table(source: str, lines, reason: str, details=None, users=None) -> pa.Table:
    n = len(lines)
    return pa.table(
        {
            "source": pa.array([source] * n, pa.string()),
            "line": pa.array(np.asarray(lines, dtype=np.int64)),
            "user": pa.array(users if users is not None else [None] * n, pa.string()),
            "reason": pa.array([reason] * n, pa.string()),
            "detail": pa.array(details if details is not None else [None] * n, pa.string()),
        },
        schema=REJECTS_SCHEMA,
    )


def is_uri(path: str) -> bool:
    """A `scheme://` input (s3, gs, hdfs, file, ...): read through pyarrow.fs."""
    return "://" in str(path)


def check_uri(path: str) -> None:
    """A `scheme://` input: Parquet events only, and it exists (a file, or a folder of files)."""
    import pyarrow.fs as pafs

    try:
        fs, inner = pafs.FileSystem.from_uri(path)
        info = fs.get_file_info(inner)
    except (OSError, ValueError, pa.ArrowException) as e:
        raise DataprepError(f"{path}: cannot open ({str(e).splitlines()[0]}); check the URI and credentials") from None
    if info.type == pafs.FileType.NotFound:
        raise DataprepError(f"{path}: input not found; check --input")
    if info.type == pafs.FileType.File and info.size == 0:
        raise DataprepError(f"{path}: empty file; nothing to read (give a file with interactions)")


def check_input(path: str) -> None:
    """The input exists, is a regular file or a folder, and is not an empty file."""
    if is_uri(path):
        return check_uri(path)
    p = Path(path)
    if not p.exists():
        raise DataprepError(f"{path}: input not found; check --input")
    if not (p.is_file() or p.is_dir()):
        raise DataprepError(
            f"{path}: not a regular file (a device, pipe or socket has no end to read to); "
            "give a file or a folder of files"
        )
    if p.is_file() and p.stat().st_size == 0:
        raise DataprepError(f"{path}: empty file; nothing to read (give a file with interactions)")


def _read_lines(path: str) -> tuple[pa.StringArray, np.ndarray]:
    """Every physical line of a text file as one string (blank lines kept, so index + 1 = line
    number), and a mask of the lines that are not UTF-8 (read as empty, rejected by the caller:
    one bad byte costs its line, not the file)."""
    try:
        t = pcsv.read_csv(
            path,
            read_options=pcsv.ReadOptions(column_names=["line"], block_size=1 << 24),
            parse_options=pcsv.ParseOptions(
                delimiter="\x1f",
                quote_char=False,
                escape_char=False,
                newlines_in_values=False,
                ignore_empty_lines=False,
            ),
            convert_options=pcsv.ConvertOptions(
                column_types={"line": pa.binary()}, strings_can_be_null=False, quoted_strings_can_be_null=False
            ),
        )
    except pa.ArrowInvalid as e:
        raise DataprepError(
            f"{path}: cannot read as text ({str(e).splitlines()[0]}); is it the right --format?"
        ) from None
    col = t.column("line")
    raw = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    try:
        return raw.cast(pa.string()), np.zeros(len(raw), bool)
    except pa.ArrowInvalid:  # some line is not UTF-8: find which, line by line (only then)
        invalid = np.zeros(len(raw), bool)
        text = []
        for i, b in enumerate(raw.to_pylist()):
            try:
                text.append(b.decode("utf-8"))
            except UnicodeDecodeError:
                invalid[i] = True
                text.append("")
        return pa.array(text, pa.string()), invalid


def _fill(mask) -> np.ndarray:
    """A boolean pyarrow array as numpy, null read as False."""
    return np.asarray(pc.fill_null(mask, False).to_numpy(zero_copy_only=False), bool)


def _match(a: pa.Array, pattern: str) -> np.ndarray:
    return _fill(pc.match_substring_regex(a, pattern))


class _Tokens:
    """Lines split into tokens, with bad lines identified and rejected."""

    def __init__(self, path: str, separator: str | None):
        lines, invalid = _read_lines(path)
        self.lines = lines
        self.path = path
        self.num_lines = len(lines)
        stripped = pc.utf8_trim_whitespace(lines)
        self.blank = np.asarray(pc.equal(stripped, "").to_numpy(zero_copy_only=False), dtype=bool) & ~invalid
        if separator is None:
            toks = pc.split_pattern_regex(stripped, r"\s+")
        else:
            toks = pc.split_pattern(stripped, separator)
        self.tokens = toks
        self.ntok = pc.list_value_length(toks).to_numpy().astype(np.int64)
        self.ntok[self.blank | invalid] = 0
        self.rejects: list[pa.Table] = []
        self.bad = self.blank | invalid
        if invalid.any():
            idx = np.flatnonzero(invalid)
            self.rejects.append(_reject_table(path, idx + 1, "not_utf8", ["the line is not valid UTF-8"] * len(idx)))

    def reject(self, mask: np.ndarray, reason: str, what: str) -> None:
        mask = mask & ~self.bad
        idx = np.flatnonzero(mask)
        if len(idx):
            sample = pc.take(pc.utf8_trim_whitespace(self.lines), pa.array(idx))
            details = [f"{what}: {s[:80]!r}" for s in sample.to_pylist()]
            self.rejects.append(_reject_table(self.path, idx + 1, reason, details))
            self.bad |= mask

    def ints(self, skip: tuple[int, ...] = ()) -> np.ndarray:
        """Tokens of good lines as int64 (bad lines rejected first). Flat, in line order;
        tokens at the positions in `skip` (inside a line) are not parsed and read as 0."""
        flat = pc.list_flatten(self.tokens)
        ntok = self.ntok_raw()
        line_of_tok = np.repeat(np.arange(self.num_lines), ntok)
        checked = None
        if skip:
            pos = np.arange(len(flat)) - np.repeat(np.cumsum(ntok) - ntok, ntok)
            checked = ~np.isin(pos, skip)
            flat = pc.filter(flat, pa.array(checked))
            line_of_tok = line_of_tok[checked]
        try:
            vals = pc.cast(flat, pa.int64()).to_numpy()
            ok_tok = vals >= 0
        except pa.ArrowInvalid:
            ok_tok = _match(flat, _INT_TOKEN) | (
                _match(flat, r"^[0-9]{19}$")  # 19 digits: compare as text
                & _fill(pc.less_equal(flat, _INT64_MAX))
            )
            vals = None
        if not ok_tok.all():
            by_reason = {"negative_id": _match(flat, _NEG_TOKEN), "id_out_of_range": _match(flat, r"^[0-9]+$")}
            by_reason["non_integer_id"] = ~by_reason["negative_id"] & ~by_reason["id_out_of_range"]
            for reason, m in by_reason.items():
                lines = np.zeros(self.num_lines, bool)
                lines[line_of_tok[~ok_tok & m]] = True
                self.reject(lines, reason, f"ids must be integers from 0 to {_INT64_MAX}")
        if vals is None:
            keep_tok = ~self.bad[line_of_tok]
            vals = np.zeros(len(flat), np.int64)
            vals[keep_tok] = pc.cast(pc.filter(flat, pa.array(keep_tok)), pa.int64()).to_numpy()
        if checked is not None:
            full = np.zeros(len(checked), np.int64)
            full[checked] = vals
            vals = full
        return vals

    def ntok_raw(self) -> np.ndarray:
        return pc.list_value_length(self.tokens).to_numpy().astype(np.int64)


def _token_events(path: str, separator: str | None, kind: str) -> tuple[dict, list[pa.Table], dict]:
    """Tokenizer path for sasrec / iclrec / movielens .dat. Returns columns of good events."""
    tk = _Tokens(path, separator)
    n = tk.num_lines
    if n == 0 or tk.blank.all():
        raise DataprepError(f"{path}: empty file; nothing to read (give a file with interactions)")
    want = {"sasrec": 2, "movielens": 4}.get(kind)
    if want is not None:
        tk.reject((tk.ntok != want) & ~tk.blank, "malformed_line", f"expected {want} fields")
    else:  # iclrec: user and at least one item
        tk.reject((tk.ntok < 2) & ~tk.blank, "malformed_line", "expected `user item [item ...]`")
    vals = tk.ints(skip=(2, 3) if kind == "movielens" else ())  # movielens: the rating may be fractional
    raw_n = tk.ntok_raw()
    offsets = np.concatenate([[0], np.cumsum(raw_n)])
    if kind == "movielens":  # the timestamp: an integer (epoch seconds), else a bad_timestamp row
        four = np.flatnonzero(~tk.bad)
        t, bad_t, _ = _parse_times(pc.take(pc.list_flatten(tk.tokens), pa.array(offsets[four] + 3)), int_only=True)
        lines_bad = np.zeros(n, bool)
        lines_bad[four[bad_t]] = True
        tk.reject(lines_bad, "bad_timestamp", "the timestamp must be an integer (epoch seconds)")
        ts_all = np.zeros(n, np.int64)
        ts_all[four] = pc.fill_null(t, 0).to_numpy()
    good = ~tk.bad
    gl = np.flatnonzero(good)
    if kind == "sasrec":
        user = vals[offsets[gl]]
        item = vals[offsets[gl] + 1]
        line = gl + 1
        ts = gl.astype(np.int64)
    elif kind == "movielens":
        user = vals[offsets[gl]]
        item = vals[offsets[gl] + 1]
        ts = ts_all[gl]
        line = gl + 1
    else:  # iclrec: each line expands to ntok-1 events
        per = raw_n[gl] - 1
        user = np.repeat(vals[offsets[gl]], per)
        starts = np.repeat(offsets[gl] + 1, per)
        within = np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)
        item = vals[starts + within]
        line = np.repeat(gl + 1, per)
        ts = np.arange(len(item), dtype=np.int64)
    counts = {"lines": int(n), "blank_lines": int(tk.blank.sum())}
    return ({"user": user, "item": item, "ts": ts, "line": line}, tk.rejects, counts)


def _fast_pairs(path: str, names: list[str], delimiter: str) -> dict | None:
    """pyarrow's parallel CSV parser for clean whitespace files; None when any line is not clean."""
    try:
        t = pcsv.read_csv(
            path,
            read_options=pcsv.ReadOptions(column_names=names, block_size=1 << 24),
            parse_options=pcsv.ParseOptions(delimiter=delimiter, quote_char=False, ignore_empty_lines=False),
            convert_options=pcsv.ConvertOptions(column_types={c: pa.int64() for c in names}),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    if any(t.column(c).null_count for c in names):  # blank lines read as nulls: let the tokenizer count them
        return None
    cols = {c: t.column(c).to_numpy() for c in names}
    if t.num_rows == 0 or any((v < 0).any() for v in cols.values()):
        return None
    return cols


def _read_sasrec(path: str) -> tuple[dict, list, dict]:
    cols = _fast_pairs(path, ["user", "item"], " ")
    if cols is None:
        return _token_events(path, None, "sasrec")
    n = len(cols["user"])
    return (
        {
            "user": cols["user"],
            "item": cols["item"],
            "ts": np.arange(n, dtype=np.int64),
            "line": np.arange(1, n + 1, dtype=np.int64),
        },
        [],
        {"lines": n, "blank_lines": 0},
    )


def _find_col(names: list[str], wanted: str, aliases: tuple[str, ...], path: str, flag: str) -> str:
    for c in (wanted, *aliases):
        if c in names:
            return c
    raise DataprepError(f"{path}: no column {wanted!r} (columns: {', '.join(names)}); set {flag} to the right name")


def _event_cols(
    names: list[str], user_col: str, item_col: str, time_col: str, defaults: bool, path: str
) -> tuple[str, str, str]:
    ua = ("user", "userId", "userid", "uid") if defaults else ()
    ia = ("item", "itemId", "movieId", "itemid", "iid") if defaults else ()
    ta = ("time", "ts", "timestamp", "event_time") if defaults else ()
    return (
        _find_col(names, user_col, ua, path, "--user-col"),
        _find_col(names, item_col, ia, path, "--item-col"),
        _find_col(names, time_col, ta, path, "--time-col"),
    )


def _cast_rows(a: pa.Array, typ: pa.DataType) -> tuple[pa.Array, np.ndarray]:
    """`a` cast to `typ`, and which values cast (the others read as null). One vectorized cast
    when all do; else halves until the few bad ones are found (callers pre-filter by shape)."""
    try:
        return a.cast(typ), np.ones(len(a), bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        if len(a) <= 1:
            return pa.nulls(len(a), typ), np.zeros(len(a), bool)
        h = len(a) // 2
        (x, ox), (y, oy) = _cast_rows(a.slice(0, h), typ), _cast_rows(a.slice(h), typ)
        return pa.concat_arrays([x, y]), np.concatenate([ox, oy])


_TIME_INT = r"^[+-]?[0-9]{1,19}$"
_TIME_NUM = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$"
_TIME_ISO = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}"  # date
    r"([T ][0-9]{2}(:[0-9]{2}(:[0-9]{2}(\.[0-9]{1,9})?)?)?)?"  # [time[:min[:sec[.frac]]]]
    r"(Z|[+-][0-9]{2}(:?[0-9]{2})?)?$"
)  # [zone]
_TIME_ZONE = r"[T ][0-9:.]+(Z|[+-][0-9]{2}(:?[0-9]{2})?)$"


def _parse_times(s: pa.Array, int_only: bool = False) -> tuple[pa.Array, np.ndarray, str]:
    """String timestamps -> int64, row by row. Returns the values (null where missing or bad),
    which rows are bad, and what a good value looks like. A column holds one kind of time:
    ISO-8601 if more of its values are that than numbers (-> microseconds, UTC; times without a zone
    read as UTC), else numbers: integers if all are (epoch, any unit, kept as they are), else seconds
    with a fraction (-> microseconds). A value not of the column's kind is a bad row."""
    s = pc.utf8_trim_whitespace(s)
    n = len(s)
    for typ in (pa.int64(),) if int_only else (pa.int64(), pa.timestamp("us")):
        try:  # a clean column: one cast, no per-row work
            return s.cast(typ).cast(pa.int64()), np.zeros(n, bool), ""
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    vals, ok = np.zeros(n, np.int64), np.zeros(n, bool)
    is_int, is_num = _match(s, _TIME_INT), _match(s, _TIME_NUM)
    is_iso = np.zeros(n, bool) if int_only else _match(s, _TIME_ISO)

    def put(mask, typ):
        v, good = _cast_rows(pc.filter(s, pa.array(mask)), typ)
        vals[mask] = pc.fill_null(v.cast(pa.int64()), 0).to_numpy()
        ok[mask] = good

    if is_iso.sum() > is_num.sum():
        zoned = is_iso & _match(s, _TIME_ZONE)
        put(is_iso & ~zoned, pa.timestamp("us"))
        put(zoned, pa.timestamp("us", tz="UTC"))
        what = "an ISO-8601 time like the column's others"
    elif int_only or is_int.sum() == is_num.sum():
        put(is_int, pa.int64())  # 19 digits may still overflow: _cast_rows finds those
        what = "an integer (epoch) like the column's others"
    else:
        us = np.round(pc.filter(s, pa.array(is_num)).cast(pa.float64()).to_numpy() * 1e6)
        fits = np.isfinite(us) & (np.abs(us) < 2.0**63)
        vals[is_num] = np.where(fits, us, 0).astype(np.int64)
        ok[is_num] = fits
        what = "a number (epoch seconds) like the column's others"
    null = np.asarray(s.is_null().to_numpy(zero_copy_only=False), bool)
    bad = ~ok & ~null
    return pa.array(vals, mask=~ok), bad, what


def _as_id(arr, path: str, col: str) -> pa.Array:
    a = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    if pa.types.is_dictionary(a.type):
        a = a.cast(a.type.value_type)
    if pa.types.is_integer(a.type):
        try:
            return a.cast(pa.int64())
        except pa.ArrowInvalid:  # uint64 above int64: ids are opaque, keep them exact as text
            return a.cast(pa.string())
    if pa.types.is_string(a.type) or pa.types.is_large_string(a.type):
        return a.cast(pa.string())
    if pa.types.is_floating(a.type):
        vals = a.to_numpy(zero_copy_only=False)
        finite = np.isfinite(vals)
        v = vals[finite]
        frac = v[v != np.round(v)]
        if len(frac):
            raise DataprepError(
                f"{path}: column {col!r} holds non-integer numbers (for example {frac[0]}); "
                "ids must be integers or strings"
            )
        big = v[np.abs(v) >= 2.0**63]
        if len(big):
            raise DataprepError(
                f"{path}: column {col!r} holds numbers beyond int64 (for example {big[0]:g}); "
                "store large ids as integers or strings, not floats"
            )
        return pa.array(np.where(finite, vals, 0).astype(np.int64), mask=~finite | np.asarray(a.is_null()))
    raise DataprepError(f"{path}: column {col!r} has type {a.type}; ids must be integers or strings")


def _csv_ids(a: pa.Array) -> pa.Array:
    """CSV ids typed as pyarrow would infer them, but never lossily: int64 when every id is one,
    whole floats as integers (see _as_id); else opaque strings (an id above int64 stays exact)."""
    try:
        return a.cast(pa.int64())
    except pa.ArrowInvalid:
        pass
    if not pc.all(pc.match_substring_regex(a, r"^[+-]?[0-9]+$")).as_py():
        try:
            return a.cast(pa.float64())
        except pa.ArrowInvalid:
            pass
    return a


def _as_time(arr, path: str, col: str) -> tuple[pa.Array, np.ndarray, str]:
    """Timestamps as int64 (nulls kept) and the rows whose value is not a time (strings only)."""
    a = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    if pa.types.is_dictionary(a.type):
        a = a.cast(a.type.value_type)
    t = a.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return _parse_times(a.cast(pa.string()))
    none = np.zeros(len(a), bool)
    try:
        if pa.types.is_timestamp(t):
            return a.cast(pa.timestamp("us")).cast(pa.int64()), none, ""
        if pa.types.is_date(t):
            return a.cast(pa.timestamp("s")).cast(pa.int64()), none, ""
        if pa.types.is_integer(t):
            return a.cast(pa.int64()), none, ""
        if pa.types.is_floating(t):
            # fractional seconds kept to the microsecond
            return pc.round(pc.multiply(a, 1e6)).cast(pa.int64()), none, ""
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise DataprepError(
            f"{path}: column {col!r} is not a readable timestamp ({str(e).splitlines()[0]}); "
            "use integers (epoch) or ISO-8601 times"
        ) from None
    raise DataprepError(
        f"{path}: column {col!r} has type {t}; timestamps must be integers, floats, dates, times or strings of those"
    )


def _csv_header(path: str, delimiter: str) -> list[str]:
    with pa.input_stream(path) as f:  # decompresses .gz
        head = f.read(1 << 20)
    first = head.split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8-sig", errors="replace")
    return next(csv.reader([first], delimiter=delimiter)) if first.strip() else []


def _read_csv(path: str, delimiter: str, cols: tuple[str, ...]) -> tuple[pa.Table, np.ndarray, list, np.ndarray]:
    """The three event columns of a CSV as strings: (table, each row's line number, rejected rows,
    which rows are not UTF-8). A row with the wrong number of fields is rejected (malformed_line),
    one with bytes that are not UTF-8 in an event column too (not_utf8); the rest is read.
    Line = 1-based record number, header = 1 (the physical line unless a quoted value spans
    lines); blank lines are kept as records so that the numbers stay right."""

    def attempt(source, threads):
        bad = []

        def skip(row):
            bad.append(row)
            return "skip"

        t = pcsv.read_csv(
            source,
            read_options=pcsv.ReadOptions(use_threads=threads, block_size=1 << 24),
            parse_options=pcsv.ParseOptions(delimiter=delimiter, ignore_empty_lines=False, invalid_row_handler=skip),
            convert_options=pcsv.ConvertOptions(
                include_columns=list(cols), column_types={c: pa.string() for c in cols}, strings_can_be_null=True
            ),
        )
        return t, bad

    replaced = False
    hook = sys.unraisablehook
    # pyarrow decodes a bad row's text before it calls the handler: bytes that are not UTF-8 make that
    # fail, printed as "Exception ignored ..." (a traceback) before the read fails; we read again below
    sys.unraisablehook = lambda u: None if isinstance(u.exc_value, UnicodeDecodeError) else hook(u)
    try:
        t, bad = attempt(path, True)
        if bad:  # only a serial read numbers the bad rows
            t, bad = attempt(path, False)
    except pa.ArrowInvalid:
        # pyarrow can neither hand over a bad row nor fill a string column holding bytes that are
        # not UTF-8: read again with those bytes replaced (U+FFFD) and reject the rows holding one
        with pa.input_stream(path) as f:  # decompresses .gz
            buf = pa.py_buffer(f.read().decode("utf-8", errors="replace").encode())
        try:
            t, bad = attempt(buf, False)
        except pa.ArrowInvalid as e:
            raise DataprepError(
                f"{path}: cannot read as CSV events ({str(e).splitlines()[0]}); check --format and the file"
            ) from None
        replaced = True
    finally:
        sys.unraisablehook = hook
    invalid = np.zeros(t.num_rows, bool)
    if replaced:
        for c in cols:
            invalid |= _match(t.column(c).combine_chunks(), "\ufffd")
    rejects = []
    for reason in ("malformed_line", "not_utf8"):
        rows = [r for r in bad if ("\ufffd" in r.text) == (reason == "not_utf8")]
        if rows:
            rejects.append(
                _reject_table(
                    path,
                    [r.number for r in rows],
                    reason,
                    [f"expected {r.expected_columns} fields, got {r.actual_columns}: {r.text[:80]!r}" for r in rows],
                )
            )
    keep = np.ones(t.num_rows + len(bad) + 2, bool)  # index = line number
    keep[:2] = False
    keep[[r.number for r in bad]] = False
    return t, np.flatnonzero(keep), rejects, invalid


def _read_parquet(path: str, user_col: str, item_col: str, time_col: str, defaults: bool) -> tuple[pa.Table, tuple]:
    dataset = None
    try:
        dataset = pds.dataset(path, format="parquet")
        cols = _event_cols(dataset.schema.names, user_col, item_col, time_col, defaults, path)
        return dataset.to_table(columns=list(cols)), cols
    except (OSError, ValueError) as e:
        # pyarrow reports bad content as ArrowInvalid / OSError without errno / UnicodeDecodeError;
        # an OSError with errno (permissions, I/O) is not the file's content: the caller reports it
        if isinstance(e, OSError) and e.errno is not None:
            raise
        name = path
        if dataset is not None and Path(path).is_dir():  # which file of the folder (error path only)
            name = next((f for f in dataset.files if not _parquet_readable(f)), path)
        raise DataprepError(
            f"{name}: not a readable Parquet file ({str(e).splitlines()[0]}); it may be "
            "truncated, still being written or not Parquet; check the file and --format"
        ) from None


def _parquet_readable(f: str) -> bool:
    try:
        pds.dataset(f, format="parquet").to_table()
        return True
    except (OSError, ValueError):
        return False


def _read_events(path: str, user_col: str, item_col: str, time_col: str, defaults: bool) -> tuple[dict, list, dict]:
    is_csv = path.endswith((".csv", ".csv.gz", ".tsv"))
    rejects: list[pa.Table] = []
    invalid: np.ndarray | None = None
    if is_csv:
        delimiter = "\t" if path.endswith(".tsv") else ","
        try:
            names = _csv_header(path, delimiter)
            if not names:
                raise DataprepError(f"{path}: empty file; nothing to read (give a file with interactions)")
            cols = _event_cols(names, user_col, item_col, time_col, defaults, path)
            table, line, rejects, invalid = _read_csv(path, delimiter, cols)
        except (OSError, ValueError) as e:  # e.g. a truncated .gz (an OSError with errno is the system's: raised)
            if isinstance(e, OSError) and e.errno is not None:
                raise
            raise DataprepError(
                f"{path}: cannot read as CSV events ({str(e).splitlines()[0]}); check --format and the file"
            ) from None
    else:
        table, cols = _read_parquet(path, user_col, item_col, time_col, defaults)
        line = np.arange(1, table.num_rows + 1, dtype=np.int64)
    if table.num_rows == 0 and not rejects:
        raise DataprepError(f"{path}: no rows; nothing to read (give a file with interactions)")
    return _table_events(path, table, cols, line, rejects, invalid, is_csv)


def _table_events(
    path: str,
    table: pa.Table,
    cols: tuple[str, str, str],
    line: np.ndarray,
    rejects: list,
    invalid: "np.ndarray | None",
    is_csv: bool,
    calls: "list[int] | None" = None,
) -> tuple[dict, list, dict]:
    """One file's (or one batch's) typed events and rejects. `calls`, when given, receives for
    each reject table added the number of the check that made it (a batched reader restores
    the whole file's reject order from them)."""
    uc, ic, tc = cols
    raw = [table.column(c).combine_chunks() for c in cols]
    n = table.num_rows
    blank = np.zeros(n, bool)
    if is_csv:  # strings: trimmed, "" is missing; a row with none of the three is a blank line
        assert invalid is not None  # _read_csv says of every row whether it is UTF-8
        # values of rows that are not UTF-8 are dropped first: they must not make a column text
        drop = pa.array(invalid)
        raw = [
            pc.if_else(pc.or_kleene(pc.equal(a, ""), drop), pa.scalar(None, pa.string()), a)
            for a in (pc.utf8_trim_whitespace(a) for a in raw)
        ]
        blank = np.logical_and.reduce([_fill(a.is_null()) for a in raw]) & ~invalid
        raw[0], raw[1] = _csv_ids(raw[0]), _csv_ids(raw[1])
    user = _as_id(raw[0], path, uc)
    item = _as_id(raw[1], path, ic)
    ts, bad_ts, ts_what = _as_time(raw[2], path, tc)
    skipped = sum(r.num_rows for r in rejects)  # rows the CSV reader rejected
    bad = blank.copy()
    check = 0

    def reject(mask, reason, detail):
        nonlocal bad, check
        check += 1
        mask = mask & ~bad
        if mask.any():
            if calls is not None:
                calls.append(check)
            idx = np.flatnonzero(mask)
            u = pc.take(user, pa.array(idx)).cast(pa.string()).to_pylist()
            det = detail(idx) if callable(detail) else [detail] * len(idx)
            rejects.append(_reject_table(path, line[idx], reason, det, u))
            bad = bad | mask

    if invalid is not None:
        reject(invalid, "not_utf8", "a value is not valid UTF-8")
    for a, name in ((user, uc), (item, ic), (ts, tc)):
        null = _fill(a.is_null())
        # bad times are null too
        reject(null & ~bad_ts if a is ts else null, "missing_value", f"column {name!r} is empty")
    reject(
        bad_ts,
        "bad_timestamp",
        lambda idx: [
            f"column {tc!r}: {v[:40]!r} is not {ts_what}"
            for v in pc.take(raw[2], pa.array(idx)).cast(pa.string()).to_pylist()
        ],
    )
    for a, name in ((user, uc), (item, ic)):
        if pa.types.is_integer(a.type):
            reject(_fill(pc.less(a, 0)), "negative_id", f"column {name!r}: ids must be >= 0")
        else:
            reject(_fill(pc.equal(pc.utf8_trim_whitespace(a), "")), "missing_value", f"column {name!r} is blank")
    keep = ~bad
    take = pa.array(np.flatnonzero(keep))
    out = {
        "user": user if keep.all() else pc.take(user, take),
        "item": item if keep.all() else pc.take(item, take),
        "ts": pc.fill_null(ts, 0).to_numpy()[keep],
        "line": line[keep],
    }
    return out, rejects, {"lines": n + skipped, "blank_lines": int(blank.sum())}


def _concat(parts: list[tuple[dict, list, dict]], paths: list[str], has_time: bool) -> Interactions:
    def ids(key):
        arrs = [p[0][key] for p in parts]
        # no type=: zero-copy
        arrs = [a if isinstance(a, pa.Array) else pa.array(np.ascontiguousarray(a, dtype=np.int64)) for a in arrs]
        if len({a.type for a in arrs}) > 1:  # mixed int/string across files: compare as strings
            arrs = [a.cast(pa.string()) for a in arrs]
        return pa.concat_arrays(arrs) if len(arrs) > 1 else arrs[0]

    ts_parts, off = [], 0
    for cols, _, _ in parts:
        t = np.asarray(cols["ts"], dtype=np.int64)
        ts_parts.append(t if has_time else t + off)  # files in order: later files are later
        off += len(t)
    counts: dict = {}
    for _, _, c in parts:
        for k, v in c.items():
            counts[k] = counts.get(k, 0) + v
    return Interactions(
        user=ids("user"),
        item=ids("item"),
        ts=np.concatenate(ts_parts),
        source=np.concatenate([np.full(len(p[0]["line"]), i, np.int32) for i, p in enumerate(parts)]),
        line=np.concatenate([np.asarray(p[0]["line"], np.int64) for p in parts]),
        paths=paths,
        has_time=has_time,
        rejects=[r for p in parts for r in p[1]],
        counts=counts,
    )


def _columns(user_col: str, item_col: str, time_col: str, unknown: dict) -> bool:
    """Check the reader options; True when the event columns are the defaults (aliases allowed)."""
    if unknown:
        raise DataprepError(
            f"unknown reader option(s): {', '.join(sorted(unknown))}; readers take user_col, item_col, time_col"
        )
    return (user_col, item_col, time_col) == ("user_id", "item_id", "timestamp")


def read_file(path: str, fmt: str, user_col: str, item_col: str, time_col: str, defaults: bool) -> tuple:
    """One input file whole: (event columns, rejects, counts), as `read` concatenates them."""
    check_input(path)
    if is_uri(path) and (fmt != "events" or path.endswith((".csv", ".csv.gz", ".tsv"))):
        raise DataprepError(
            f"{path}: only Parquet events are read from a URI (--format events); copy other files to a local folder"
        )
    if fmt == "sasrec":
        return _read_sasrec(path)
    if fmt == "iclrec":
        return _token_events(path, None, "iclrec")
    if fmt == "movielens":
        if path.endswith(".csv"):
            return _read_events(path, "userId", "movieId", "timestamp", False)
        return _token_events(path, "::", "movielens")
    return _read_events(path, user_col, item_col, time_col, defaults)


def _streamable(dataset: pds.Dataset, cols: tuple[str, str, str]) -> bool:
    """Whether batches of this Parquet input read exactly as the whole file: not when a string
    time column (its kind is decided over the whole column) or a uint64 id column (int64 or text
    by its largest value) is there."""
    types = [dataset.schema.field(c).type for c in cols]
    types = [t.value_type if pa.types.is_dictionary(t) else t for t in types]
    return not (
        pa.types.is_string(types[2])
        or pa.types.is_large_string(types[2])
        or any(pa.types.is_uint64(t) for t in types[:2])
    )


def iter_file(
    path: str,
    fmt: str,
    batch_rows: int,
    *,
    user_col: str = "user_id",
    item_col: str = "item_id",
    time_col: str = "timestamp",
    **unknown,
) -> Iterator[tuple[dict, list[tuple[int, pa.Table]], dict]]:
    """One input file as parts of at most `batch_rows` rows where the format allows (Parquet
    events), else whole: (event columns, [(check number, reject table)], counts). The parts'
    events concatenate to `read_file`'s; its rejects are each check's tables concatenated, in
    check order (see _table_events)."""
    defaults = _columns(user_col, item_col, time_col, unknown)
    parquet = fmt == "events" and not path.endswith((".csv", ".csv.gz", ".tsv"))
    if parquet:
        check_input(path)
        dataset, cols = _parquet_dataset(path, user_col, item_col, time_col, defaults)
        if _streamable(dataset, cols):
            yield from _parquet_batches(path, dataset, cols, batch_rows)
            return
    cols_, rejects, counts = read_file(path, fmt, user_col, item_col, time_col, defaults)
    yield cols_, list(enumerate(rejects)), counts


def _parquet_dataset(path: str, user_col: str, item_col: str, time_col: str, defaults: bool) -> tuple:
    try:
        dataset = pds.dataset(path, format="parquet")
        return dataset, _event_cols(dataset.schema.names, user_col, item_col, time_col, defaults, path)
    except (OSError, ValueError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise
        raise DataprepError(
            f"{path}: not a readable Parquet file ({str(e).splitlines()[0]}); it may be "
            "truncated, still being written or not Parquet; check the file and --format"
        ) from None


def _parquet_batches(path: str, dataset: pds.Dataset, cols: tuple, batch_rows: int) -> Iterator[tuple]:
    rows = 0
    # no pre-buffering and one batch of read-ahead: pyarrow's defaults hold ~1 GB of a 100M-row file
    batches = dataset.to_batches(
        columns=list(cols),
        batch_size=batch_rows,
        use_threads=False,
        batch_readahead=1,
        fragment_readahead=1,
        fragment_scan_options=pds.ParquetFragmentScanOptions(pre_buffer=False),
    )
    while True:
        try:
            batch = next(batches, None)
        except (OSError, ValueError) as e:
            if isinstance(e, OSError) and e.errno is not None:
                raise
            name = next((f for f in dataset.files if not _parquet_readable(f)), path)
            raise DataprepError(
                f"{name}: not a readable Parquet file ({str(e).splitlines()[0]}); it may be "
                "truncated, still being written or not Parquet; check the file and --format"
            ) from None
        if batch is None:
            break
        if batch.num_rows == 0:
            continue
        line = np.arange(rows + 1, rows + batch.num_rows + 1, dtype=np.int64)
        calls: list[int] = []
        out, rejects, counts = _table_events(
            path, pa.Table.from_batches([batch]), cols, line, [], None, False, calls=calls
        )
        rows += batch.num_rows
        yield out, list(zip(calls, rejects, strict=True)), counts
    if rows == 0:
        raise DataprepError(f"{path}: no rows; nothing to read (give a file with interactions)")


def read(
    paths: "str | list[str]",
    fmt: str,
    *,
    user_col: str = "user_id",
    item_col: str = "item_id",
    time_col: str = "timestamp",
    **unknown,
) -> Interactions:
    """Read every input file of format `fmt`; bad rows become rejects (see module doc)."""
    defaults = _columns(user_col, item_col, time_col, unknown)
    if fmt not in FORMATS:
        raise DataprepError(f"--format {fmt!r}: unknown; choose one of {', '.join(FORMATS)}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [str(p) for p in paths]
    if not paths:
        raise DataprepError("--input: no input files given")
    parts = [read_file(p, fmt, user_col, item_col, time_col, defaults) for p in paths]
    return _concat(parts, paths, has_time=fmt in TIME_FORMATS)
