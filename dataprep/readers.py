"""Readers: raw interaction files -> one columnar table of (user, item, time) events.

Formats (pyarrow only on the hot path):
  sasrec     one `user item` pair per line, oldest first (kang205/SASRec data)
  iclrec     one line per user, `user item item ...`, oldest first (salesforce/ICLRec data)
  movielens  ratings.dat (`user::item::rating::timestamp`) or ratings.csv (with header)
  events     Parquet (file or folder) or CSV with user, item and timestamp columns

Whitespace formats are parsed by pyarrow's CSV reader when every line is clean;
on any parse error the reader falls back to a line-by-line tokenizer that rejects
only the bad lines, each with its 1-based line number and a reason.
Bad rows become rejects; problems with a whole file (missing, empty, missing
column) raise DataprepError naming the file and what to do.
"""

import os
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
_INT_TOKEN = r"^[0-9]{1,18}$"  # fits int64; longer digit strings are rejected as non_integer_id
_NEG_TOKEN = r"^-[0-9]+$"


@dataclass
class Interactions:
    """Events in input order. `ts` orders a user's events (stable on ties);
    for formats without timestamps it is the event's position in the input."""
    user: pa.Array            # raw user ids: int64, or string for events with string ids
    item: pa.Array            # raw item ids: same rule
    ts: np.ndarray            # int64
    source: np.ndarray        # int32 index into `paths`
    line: np.ndarray          # int64 1-based line (text) or row (Parquet) number
    paths: list[str]
    has_time: bool            # real timestamps (ties and duplicates possible) vs input order
    rejects: list[pa.Table] = field(default_factory=list)
    counts: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.user)


def _reject_table(source: str, lines, reason: str, details=None, users=None) -> pa.Table:
    n = len(lines)
    return pa.table({
        "source": pa.array([source] * n, pa.string()),
        "line": pa.array(np.asarray(lines, dtype=np.int64)),
        "user": pa.array(users if users is not None else [None] * n, pa.string()),
        "reason": pa.array([reason] * n, pa.string()),
        "detail": pa.array(details if details is not None else [None] * n, pa.string()),
    }, schema=REJECTS_SCHEMA)


def check_input(path: str) -> None:
    """The input exists, is a regular file or a folder, and is not an empty file."""
    p = Path(path)
    if not p.exists():
        raise DataprepError(f"{path}: input not found; check --input")
    if not (p.is_file() or p.is_dir()):
        raise DataprepError(f"{path}: not a regular file (a device, pipe or socket has no end to read to); "
                            "give a file or a folder of files")
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
            parse_options=pcsv.ParseOptions(delimiter="\x1f", quote_char=False, escape_char=False,
                                            newlines_in_values=False, ignore_empty_lines=False),
            convert_options=pcsv.ConvertOptions(column_types={"line": pa.binary()}, strings_can_be_null=False,
                                                quoted_strings_can_be_null=False))
    except pa.ArrowInvalid as e:
        raise DataprepError(f"{path}: cannot read as text ({str(e).splitlines()[0]}); is it the right --format?") from None
    col = t.column("line")
    raw = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    try:
        return raw.cast(pa.string()), np.zeros(len(raw), bool)
    except pa.ArrowInvalid:   # some line is not UTF-8: find which, line by line (only then)
        invalid = np.zeros(len(raw), bool)
        text = []
        for i, b in enumerate(raw.to_pylist()):
            try:
                text.append(b.decode("utf-8"))
            except UnicodeDecodeError:
                invalid[i] = True
                text.append("")
        return pa.array(text, pa.string()), invalid


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
            ok_tok = np.asarray(pc.match_substring_regex(flat, _INT_TOKEN).to_numpy(zero_copy_only=False), dtype=bool)
            vals = None
        if not ok_tok.all():
            neg = np.asarray(pc.match_substring_regex(flat, _NEG_TOKEN).to_numpy(zero_copy_only=False), dtype=bool)
            bad_neg = np.zeros(self.num_lines, bool)
            bad_neg[line_of_tok[~ok_tok & neg]] = True
            bad_other = np.zeros(self.num_lines, bool)
            bad_other[line_of_tok[~ok_tok & ~neg]] = True
            self.reject(bad_neg, "negative_id", "ids must be integers >= 0")
            self.reject(bad_other, "non_integer_id", "ids must be integers >= 0")
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
    vals = tk.ints(skip=(2,) if kind == "movielens" else ())  # movielens: the rating may be fractional
    raw_n = tk.ntok_raw()
    offsets = np.concatenate([[0], np.cumsum(raw_n)])
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
        ts = vals[offsets[gl] + 3]
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
            convert_options=pcsv.ConvertOptions(column_types={c: pa.int64() for c in names}))
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
    return ({"user": cols["user"], "item": cols["item"], "ts": np.arange(n, dtype=np.int64),
             "line": np.arange(1, n + 1, dtype=np.int64)}, [], {"lines": n, "blank_lines": 0})


def _find_col(names: list[str], wanted: str, aliases: tuple[str, ...], path: str, flag: str,
              all_names: list[str] | None = None) -> str:
    for c in (wanted, *aliases):
        if c in names:
            return c
    raise DataprepError(f"{path}: no column {wanted!r} (columns: {', '.join(all_names or names)}); "
                        f"set {flag} to the right name")


def _as_id(arr: pa.ChunkedArray, path: str, col: str) -> pa.Array:
    a = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    if pa.types.is_dictionary(a.type):
        a = a.cast(a.type.value_type)
    if pa.types.is_integer(a.type):
        return a.cast(pa.int64())
    if pa.types.is_string(a.type) or pa.types.is_large_string(a.type):
        return a.cast(pa.string())
    if pa.types.is_floating(a.type):
        vals = a.to_numpy(zero_copy_only=False)
        finite = np.isfinite(vals)
        if (vals[finite] == np.round(vals[finite])).all():
            return pa.array(np.where(finite, vals, 0).astype(np.int64), mask=~finite | np.asarray(a.is_null()))
        raise DataprepError(f"{path}: column {col!r} holds non-integer numbers (for example {vals[finite][vals[finite] != np.round(vals[finite])][0]}); ids must be integers or strings")
    raise DataprepError(f"{path}: column {col!r} has type {a.type}; ids must be integers or strings")


def _as_time(arr: pa.ChunkedArray, path: str, col: str) -> pa.Array:
    a = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    t = a.type
    try:
        if pa.types.is_timestamp(t):
            return a.cast(pa.timestamp("us")).cast(pa.int64())
        if pa.types.is_date(t):
            return a.cast(pa.timestamp("s")).cast(pa.int64())
        if pa.types.is_integer(t):
            return a.cast(pa.int64())
        if pa.types.is_floating(t):
            return pc.round(pc.multiply(a, 1e6)).cast(pa.int64())  # fractional seconds kept to the microsecond
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return a.cast(pa.timestamp("us")).cast(pa.int64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise DataprepError(f"{path}: column {col!r} is not a readable timestamp ({str(e).splitlines()[0]}); "
                            "use integers (epoch) or ISO-8601 times") from None
    raise DataprepError(f"{path}: column {col!r} has type {t}; timestamps must be integers, floats, dates or times")


def _table_events(path: str, table: pa.Table, user_col: str, item_col: str, time_col: str,
                  defaults: bool, all_names: list[str] | None = None) -> tuple[dict, list, dict]:
    names = table.column_names
    ua = ("user", "userId", "userid", "uid") if defaults else ()
    ia = ("item", "itemId", "movieId", "itemid", "iid") if defaults else ()
    ta = ("time", "ts", "timestamp", "event_time") if defaults else ()
    uc = _find_col(names, user_col, ua, path, "--user-col", all_names)
    ic = _find_col(names, item_col, ia, path, "--item-col", all_names)
    tc = _find_col(names, time_col, ta, path, "--time-col", all_names)
    user = _as_id(table.column(uc), path, uc)
    item = _as_id(table.column(ic), path, ic)
    ts = _as_time(table.column(tc), path, tc)
    n = len(user)
    line0 = 2 if path.endswith(".csv") or path.endswith(".csv.gz") else 1  # header line
    rows = np.arange(n, dtype=np.int64)
    bad = np.zeros(n, bool)
    rejects = []

    def reject(mask, reason, detail):
        nonlocal bad
        mask = mask & ~bad
        if mask.any():
            idx = np.flatnonzero(mask)
            u = pc.take(user, pa.array(idx)).cast(pa.string()).to_pylist()
            rejects.append(_reject_table(path, idx + line0, reason, [detail] * len(idx), u))
            bad = bad | mask

    for a, name in ((user, uc), (item, ic), (ts, tc)):
        reject(np.asarray(a.is_null().to_numpy(zero_copy_only=False), bool), "missing_value", f"column {name!r} is empty")
    for a, name in ((user, uc), (item, ic)):
        if pa.types.is_integer(a.type):
            reject(np.asarray(pc.fill_null(pc.less(a, 0), False).to_numpy(zero_copy_only=False), bool),
                   "negative_id", f"column {name!r}: ids must be >= 0")
        else:
            reject(np.asarray(pc.fill_null(pc.equal(pc.utf8_trim_whitespace(a), ""), False).to_numpy(zero_copy_only=False), bool),
                   "missing_value", f"column {name!r} is blank")
    keep = ~bad
    take = pa.array(np.flatnonzero(keep))
    cols = {"user": user if keep.all() else pc.take(user, take),
            "item": item if keep.all() else pc.take(item, take),
            "ts": pc.fill_null(ts, 0).to_numpy()[keep] if ts.null_count else ts.to_numpy()[keep],
            "line": rows[keep] + line0}
    return cols, rejects, {"lines": n, "blank_lines": 0}


def _read_events(path: str, user_col: str, item_col: str, time_col: str, defaults: bool) -> tuple[dict, list, dict]:
    is_csv = path.endswith((".csv", ".csv.gz", ".tsv"))
    have = None
    try:
        if is_csv:
            table = pcsv.read_csv(path, parse_options=pcsv.ParseOptions(delimiter="\t" if path.endswith(".tsv") else ","))
        else:
            dataset = pds.dataset(path, format="parquet")
            have = dataset.schema.names
            cols = [c for c in have if c in {user_col, item_col, time_col, "user", "userId", "item", "itemId",
                                             "movieId", "time", "ts", "timestamp", "uid", "iid", "userid", "itemid",
                                             "event_time"}]
            table = dataset.to_table(columns=cols or have)
    except pa.ArrowInvalid as e:
        msg = str(e).splitlines()[0]
        if "Empty CSV file" in msg:
            raise DataprepError(f"{path}: empty file; nothing to read (give a file with interactions)") from None
        raise DataprepError(f"{path}: cannot read as {'CSV' if is_csv else 'Parquet'} events ({msg}); check --format and the file") from None
    if table.num_rows == 0:
        raise DataprepError(f"{path}: no rows; nothing to read (give a file with interactions)")
    return _table_events(path, table, user_col, item_col, time_col, defaults, have)


def _concat(parts: list[tuple[dict, list, dict]], paths: list[str], has_time: bool) -> Interactions:
    def ids(key):
        arrs = [p[0][key] for p in parts]
        arrs = [a if isinstance(a, pa.Array) else pa.array(np.ascontiguousarray(a, dtype=np.int64)) for a in arrs]  # no type=: zero-copy
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
        user=ids("user"), item=ids("item"), ts=np.concatenate(ts_parts),
        source=np.concatenate([np.full(len(p[0]["line"]), i, np.int32) for i, p in enumerate(parts)]),
        line=np.concatenate([np.asarray(p[0]["line"], np.int64) for p in parts]),
        paths=paths, has_time=has_time,
        rejects=[r for p in parts for r in p[1]], counts=counts)


def read(paths: "str | list[str]", fmt: str, *, user_col: str = "user_id", item_col: str = "item_id",
         time_col: str = "timestamp", **unknown) -> Interactions:
    """Read every input file of format `fmt`; bad rows become rejects (see module doc)."""
    if unknown:
        raise DataprepError(f"unknown reader option(s): {', '.join(sorted(unknown))}; "
                            "readers take user_col, item_col, time_col")
    if fmt not in FORMATS:
        raise DataprepError(f"--format {fmt!r}: unknown; choose one of {', '.join(FORMATS)}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [str(p) for p in paths]
    if not paths:
        raise DataprepError("--input: no input files given")
    defaults = (user_col, item_col, time_col) == ("user_id", "item_id", "timestamp")
    parts = []
    for p in paths:
        check_input(p)
        if fmt == "sasrec":
            parts.append(_read_sasrec(p))
        elif fmt == "iclrec":
            parts.append(_token_events(p, None, "iclrec"))
        elif fmt == "movielens":
            if p.endswith(".csv"):
                parts.append(_read_events(p, "userId", "movieId", "timestamp", False))
            else:
                parts.append(_token_events(p, "::", "movielens"))
        else:
            parts.append(_read_events(p, user_col, item_col, time_col, defaults))
    return _concat(parts, paths, has_time=fmt in ("movielens", "events"))
