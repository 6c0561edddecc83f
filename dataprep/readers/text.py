"""The whitespace formats (sasrec, iclrec, movielens .dat): pyarrow's CSV parser when every line is
clean, else a tokenizer that rejects only the bad lines, each with its 1-based line number."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from dataprep.errors import DataprepError, cause
from dataprep.readers.values import INT64_MAX, as_bool, matches, parse_times, rejected_rows

_INT_TOKEN = r"^[0-9]{1,18}$"  # fits int64 (19 digits are checked against INT64_MAX; more: id_out_of_range)
_NEG_TOKEN = r"^-[0-9]+$"


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
        raise DataprepError(f"{path}: cannot read as text ({cause(e)}); is it the right --format?") from None
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
            self.rejects.append(rejected_rows(path, idx + 1, "not_utf8", ["the line is not valid UTF-8"] * len(idx)))

    def reject(self, mask: np.ndarray, reason: str, what: str) -> None:
        mask = mask & ~self.bad
        idx = np.flatnonzero(mask)
        if len(idx):
            sample = pc.take(pc.utf8_trim_whitespace(self.lines), pa.array(idx))
            details = [f"{what}: {s[:80]!r}" for s in sample.to_pylist()]
            self.rejects.append(rejected_rows(self.path, idx + 1, reason, details))
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
            ok_tok = matches(flat, _INT_TOKEN) | (
                matches(flat, r"^[0-9]{19}$")  # 19 digits: compare as text
                & as_bool(pc.less_equal(flat, INT64_MAX))
            )
            vals = None
        if not ok_tok.all():
            by_reason = {"negative_id": matches(flat, _NEG_TOKEN), "id_out_of_range": matches(flat, r"^[0-9]+$")}
            by_reason["non_integer_id"] = ~by_reason["negative_id"] & ~by_reason["id_out_of_range"]
            for reason, m in by_reason.items():
                lines = np.zeros(self.num_lines, bool)
                lines[line_of_tok[~ok_tok & m]] = True
                self.reject(lines, reason, f"ids must be integers from 0 to {INT64_MAX}")
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


def token_events(path: str, separator: str | None, kind: str) -> tuple[dict, list[pa.Table], dict]:
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
        t, bad_t, _ = parse_times(pc.take(pc.list_flatten(tk.tokens), pa.array(offsets[four] + 3)), int_only=True)
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


def read_sasrec(path: str) -> tuple[dict, list, dict]:
    cols = _fast_pairs(path, ["user", "item"], " ")
    if cols is None:
        return token_events(path, None, "sasrec")
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
