"""Event tables (CSV or Parquet with user, item and time columns) -> typed events and rejects.

CSV is read as strings and typed here, so one bad row costs that row; Parquet's typed
columns are used as they are, and a file pyarrow cannot read is an error naming it."""

import codecs
import csv
import io
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.dataset as pds

from dataprep.errors import DataprepError, cause
from dataprep.readers.values import (
    as_bool,
    as_id,
    as_time,
    csv_ids,
    id_kind,
    matches,
    merge_id_kinds,
    merge_time_kinds,
    rejected_rows,
    time_kind,
)


def _find_col(names: list[str], wanted: str, aliases: tuple[str, ...], path: str, flag: str) -> str:
    for c in (wanted, *aliases):
        if c in names:
            return c
    # the names are not listed: a CSV "header" may be the first line of any file (a secret)
    raise DataprepError(f"{path}: no column {wanted!r} among its {len(names)} columns; set {flag} to the right name")


def event_cols(
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


def csv_header(path: str, delimiter: str) -> list[str]:
    with pa.input_stream(path) as f:  # decompresses .gz
        head = f.read(1 << 20)
    first = head.split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8-sig", errors="replace")
    return next(csv.reader([first], delimiter=delimiter)) if first.strip() else []


def _csv_attempt(source, delimiter: str, cols: tuple[str, ...], threads: bool) -> tuple[pa.Table, list]:
    """One pyarrow read of the event columns as strings, and the rows it skipped (wrong field count)."""
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


def _csv_read(path: str, delimiter: str, cols: tuple[str, ...]) -> tuple[pa.Table, list, bool]:
    """The table, its skipped rows, and whether bytes that are not UTF-8 were replaced (U+FFFD)."""
    hook = sys.unraisablehook
    # pyarrow decodes a bad row's text before it calls the handler: bytes that are not UTF-8 make that
    # fail, printed as "Exception ignored ..." (a traceback) before the read fails; we read again below
    sys.unraisablehook = lambda u: None if isinstance(u.exc_value, UnicodeDecodeError) else hook(u)
    try:
        t, bad = _csv_attempt(path, delimiter, cols, True)
        if bad:  # only a serial read numbers the bad rows
            t, bad = _csv_attempt(path, delimiter, cols, False)
        return t, bad, False
    except pa.ArrowInvalid:
        # pyarrow can neither hand over a bad row nor fill a string column holding bytes that are
        # not UTF-8: read again with those bytes replaced (U+FFFD) and reject the rows holding one
        with pa.input_stream(path) as f:  # decompresses .gz
            buf = pa.py_buffer(f.read().decode("utf-8", errors="replace").encode())
        try:
            t, bad = _csv_attempt(buf, delimiter, cols, False)
        except pa.ArrowInvalid as e:
            raise DataprepError(
                f"{path}: cannot read as CSV events ({cause(e)}); check --format and the file"
            ) from None
        return t, bad, True
    finally:
        sys.unraisablehook = hook


def _skipped_rows(path: str, bad: list) -> list[tuple[int, pa.Table]]:
    """The rows pyarrow skipped (wrong field count) as rejects: malformed_line, then not_utf8
    (a row holding a replaced byte), each with its number in a file's reject order (-2, -1)."""
    out = []
    for tag, reason in ((-2, "malformed_line"), (-1, "not_utf8")):
        rows = [r for r in bad if ("\ufffd" in r.text) == (reason == "not_utf8")]
        if rows:
            details = [f"expected {r.expected_columns} fields, got {r.actual_columns}: {r.text[:80]!r}" for r in rows]
            out.append((tag, rejected_rows(path, [r.number for r in rows], reason, details)))
    return out


def _read_csv(path: str, delimiter: str, cols: tuple[str, ...]) -> tuple[pa.Table, np.ndarray, list, np.ndarray]:
    """The three event columns of a CSV as strings: (table, each row's line number, rejected rows,
    which rows are not UTF-8). A row with the wrong number of fields is rejected (malformed_line),
    one with bytes that are not UTF-8 in an event column too (not_utf8); the rest is read.
    Line = 1-based record number, header = 1 (the physical line unless a quoted value spans
    lines); blank lines are kept as records so that the numbers stay right."""
    t, bad, replaced = _csv_read(path, delimiter, cols)
    invalid = np.zeros(t.num_rows, bool)
    if replaced:
        for c in cols:
            invalid |= matches(t.column(c).combine_chunks(), "\ufffd")
    rejects = [t for _, t in _skipped_rows(path, bad)]
    keep = np.ones(t.num_rows + len(bad) + 2, bool)  # index = line number
    keep[:2] = False
    keep[[r.number for r in bad]] = False
    return t, np.flatnonzero(keep), rejects, invalid


class Restart(Exception):
    """A CSV file read in parts must be read again from its start: with the whole file's kinds
    (a part's own differed), or with bytes that are not UTF-8 replaced (`replace`)."""

    def __init__(self, kinds: tuple[str, str, str] | None, replace: bool):
        super().__init__(f"read again: kinds {kinds}, replace {replace}")
        self.kinds, self.replace = kinds, replace


class _Replacing(io.RawIOBase):
    """A file's bytes with those that are not UTF-8 replaced (U+FFFD), decoded as they stream."""

    def __init__(self, path: str):
        self.src = pa.input_stream(path)  # decompresses .gz
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")
        self.buf, self.eof = b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while len(self.buf) < len(b) and not self.eof:
            chunk = self.src.read(1 << 20)
            self.eof = not chunk
            self.buf += self.dec.decode(chunk, final=self.eof).encode()
        n = min(len(b), len(self.buf))
        b[:n], self.buf = self.buf[:n], self.buf[n:]
        return n

    def close(self) -> None:
        self.src.close()
        super().close()


def _csv_failed(path: str, e: Exception, kinds, replace: bool) -> Exception:
    """What a failed streaming read raises: the system's error, Restart (bytes that are not UTF-8
    may be the cause: read again with them replaced), or the file's error."""
    if isinstance(e, OSError) and e.errno is not None:
        return e
    if isinstance(e, pa.ArrowInvalid) and not replace:
        return Restart(kinds, True)
    return DataprepError(f"{path}: cannot read as CSV events ({cause(e)}); check --format and the file")


def _good_lines(start: int, n: int, skipped: list[int]) -> np.ndarray:
    """The record numbers of the next n rows read from record `start` on, past `skipped` ones."""
    cand = np.arange(start, start + n + len(skipped), dtype=np.int64)
    return cand[~np.isin(cand, skipped)][:n]


def csv_batches(
    path: str, delimiter: str, cols: tuple, batch_rows: int, kinds=None, replace: bool = False
) -> Iterator[tuple]:
    """A CSV file in parts of about `batch_rows` rows (pyarrow's streaming reader), as
    parquet_batches yields them; the parts concatenate to _read_csv + table_events of the whole
    file. Raises Restart when the file must be read again (then nothing yielded counts)."""
    chosen, bad, skipped = CsvKinds(kinds), [], []
    line, rows = 2, 0

    def skip(row):
        bad.append(row)
        return "skip"

    hook = sys.unraisablehook  # as in _read_csv: a bad row that is not UTF-8 fails the read quietly
    sys.unraisablehook = lambda u: None if isinstance(u.exc_value, UnicodeDecodeError) else hook(u)
    try:
        try:
            reader = pcsv.open_csv(
                io.BufferedReader(_Replacing(path)) if replace else path,
                read_options=pcsv.ReadOptions(use_threads=False, block_size=max(batch_rows * 16, 1 << 16)),
                parse_options=pcsv.ParseOptions(
                    delimiter=delimiter, ignore_empty_lines=False, invalid_row_handler=skip
                ),
                convert_options=pcsv.ConvertOptions(
                    include_columns=list(cols), column_types={c: pa.string() for c in cols}, strings_can_be_null=True
                ),
            )
        except (OSError, ValueError) as e:
            raise _csv_failed(path, e, kinds, replace) from None
        while True:
            try:
                batch = next(reader, None)
            except (OSError, ValueError) as e:
                raise _csv_failed(path, e, kinds, replace) from None
            if batch is None and not bad:
                break
            table = (
                pa.Table.from_batches([batch])
                if batch is not None
                else pa.table({c: pa.array([], pa.string()) for c in cols})
            )
            # the reader parses ahead on its own thread: take the rows it skipped so far, once
            taken = bad[: len(bad)]
            del bad[: len(taken)]
            skipped += [r.number for r in taken]
            lines = _good_lines(line, table.num_rows, skipped)
            if len(lines):
                line = int(lines[-1]) + 1
                skipped = [x for x in skipped if x >= line]
            part = _csv_part(path, table, cols, lines, taken, replace, chosen)
            rows += part[2]["lines"]
            yield part
            if batch is None:
                break
    finally:
        sys.unraisablehook = hook
    if rows == 0:
        raise DataprepError(f"{path}: no rows; nothing to read (give a file with interactions)")
    if not chosen.exact():
        raise Restart(chosen.whole(), replace)


def _csv_part(path: str, table: pa.Table, cols: tuple, lines: np.ndarray, bad: list, replace: bool, chosen) -> tuple:
    """One part of a CSV file (`bad`: the rows skipped since the last part) as csv_batches yields it."""
    invalid = np.zeros(table.num_rows, bool)
    if replace:
        for c in cols:
            invalid |= matches(table.column(c).combine_chunks(), "\ufffd")
    tagged, calls = _skipped_rows(path, bad), list[int]()
    out, rejects, counts = table_events(path, table, cols, lines, [t for _, t in tagged], invalid, True, calls, chosen)
    return out, tagged + list(zip(calls, rejects[len(tagged) :], strict=True)), counts


def iter_csv(path: str, user_col: str, item_col: str, time_col: str, defaults: bool, batch_rows: int, kinds, replace):
    """csv_batches of a CSV events file, its columns found by name as read_events finds them."""
    delimiter = "\t" if path.endswith(".tsv") else ","
    try:
        names = csv_header(path, delimiter)
    except (OSError, ValueError) as e:
        raise _csv_failed(path, e, None, True) from None
    if not names:
        raise DataprepError(f"{path}: empty file; nothing to read (give a file with interactions)")
    cols = event_cols(names, user_col, item_col, time_col, defaults, path)
    yield from csv_batches(path, delimiter, cols, batch_rows, kinds, replace)


def _not_parquet(name: str, e: Exception) -> DataprepError:
    """The error for a Parquet file pyarrow cannot read (`e`: pyarrow's reason)."""
    return DataprepError(
        f"{name}: not a readable Parquet file ({cause(e)}); it may be "
        "truncated, still being written or not Parquet; check the file and --format"
    )


def _read_parquet(path: str, user_col: str, item_col: str, time_col: str, defaults: bool) -> tuple[pa.Table, tuple]:
    dataset = None
    try:
        dataset = pds.dataset(path, format="parquet")
        cols = event_cols(dataset.schema.names, user_col, item_col, time_col, defaults, path)
        return dataset.to_table(columns=list(cols)), cols
    except (OSError, ValueError) as e:
        # pyarrow reports bad content as ArrowInvalid / OSError without errno / UnicodeDecodeError;
        # an OSError with errno (permissions, I/O) is not the file's content: the caller reports it
        if isinstance(e, OSError) and e.errno is not None:
            raise
        name = path
        if dataset is not None and Path(path).is_dir():  # which file of the folder (error path only)
            name = next((f for f in dataset.files if not _parquet_readable(f)), path)
        raise _not_parquet(name, e) from None


def _parquet_readable(f: str) -> bool:
    try:
        pds.dataset(f, format="parquet").to_table()
        return True
    except (OSError, ValueError):
        return False


CSV_SUFFIXES = (".csv", ".csv.gz", ".tsv")  # an events file with one of these is text, else Parquet


def read_events(path: str, user_col: str, item_col: str, time_col: str, defaults: bool) -> tuple[dict, list, dict]:
    is_csv = path.endswith(CSV_SUFFIXES)
    rejects: list[pa.Table] = []
    invalid: np.ndarray | None = None
    if is_csv:
        delimiter = "\t" if path.endswith(".tsv") else ","
        try:
            names = csv_header(path, delimiter)
            if not names:
                raise DataprepError(f"{path}: empty file; nothing to read (give a file with interactions)")
            cols = event_cols(names, user_col, item_col, time_col, defaults, path)
            table, line, rejects, invalid = _read_csv(path, delimiter, cols)
        except (OSError, ValueError) as e:  # e.g. a truncated .gz (an OSError with errno is the system's: raised)
            if isinstance(e, OSError) and e.errno is not None:
                raise
            raise DataprepError(
                f"{path}: cannot read as CSV events ({cause(e)}); check --format and the file"
            ) from None
    else:
        table, cols = _read_parquet(path, user_col, item_col, time_col, defaults)
        line = np.arange(1, table.num_rows + 1, dtype=np.int64)
    if table.num_rows == 0 and not rejects:
        raise DataprepError(f"{path}: no rows; nothing to read (give a file with interactions)")
    return table_events(path, table, cols, line, rejects, invalid, is_csv)


class _RowChecks:
    """The checks of one table's rows, in order: a row is rejected by the first it fails. `calls`,
    when given, receives the number of the check that made each reject table."""

    def __init__(self, path: str, user: pa.Array, line: np.ndarray, bad: np.ndarray, rejects: list, calls):
        self.path, self.user, self.line, self.bad = path, user, line, bad
        self.rejects, self.calls, self.check = rejects, calls, 0

    def reject(self, mask: np.ndarray, reason: str, detail) -> None:
        self.check += 1
        mask = mask & ~self.bad
        if mask.any():
            if self.calls is not None:
                self.calls.append(self.check)
            idx = np.flatnonzero(mask)
            u = pc.take(self.user, pa.array(idx)).cast(pa.string()).to_pylist()
            det = detail(idx) if callable(detail) else [detail] * len(idx)
            self.rejects.append(rejected_rows(self.path, self.line[idx], reason, det, u))
            self.bad = self.bad | mask


class CsvKinds:
    """A CSV file's id and time kinds (values.csv_ids, parse_times) when it is read in parts:
    the whole file's when known (`forced`), else each part's own, with the figures that give
    the whole file's (`whole`) and whether every part's own was that (`exact`)."""

    def __init__(self, forced: tuple[str, str, str] | None = None):
        self.forced = forced
        self.parts: list[tuple] = []

    def choose(self, user: pa.Array, item: pa.Array, time: pa.Array) -> tuple[str | None, ...]:
        if self.forced or len(user) == 0:  # an empty part is typed alike whatever the kind
            return self.forced or (None, None, None)
        self.parts.append((id_kind(user), id_kind(item), time_kind(time)))
        return tuple(f[0] for f in self.parts[-1])

    def whole(self) -> tuple[str, str, str]:
        u, i, t = zip(*self.parts, strict=True) if self.parts else ((), (), ())
        return merge_id_kinds(list(u)), merge_id_kinds(list(i)), merge_time_kinds([f for _, f in t])

    def exact(self) -> bool:
        return all(tuple(f[0] for f in p) == self.whole() for p in self.parts)


def _csv_strings(
    raw: list[pa.Array], invalid: np.ndarray, kinds: CsvKinds | None
) -> tuple[list[pa.Array], np.ndarray, str | None]:
    """CSV strings trimmed, "" as missing, values of rows that are not UTF-8 dropped (they must not
    make a column text), ids typed; the blank rows (none of the three values); the time kind."""
    drop = pa.array(invalid)
    raw = [
        pc.if_else(pc.or_kleene(pc.equal(a, ""), drop), pa.scalar(None, pa.string()), a)
        for a in (pc.utf8_trim_whitespace(a) for a in raw)
    ]
    blank = np.logical_and.reduce([as_bool(a.is_null()) for a in raw]) & ~invalid
    ku, ki, kt = kinds.choose(*raw) if kinds is not None else (None, None, None)
    return [csv_ids(raw[0], ku), csv_ids(raw[1], ki), raw[2]], blank, kt


def _check_rows(chk: _RowChecks, cols, typed, raw_time: pa.Array, bad_ts, ts_what: str, invalid) -> None:
    """Every row check, in the order whose reject tables a batched reader restores."""
    (uc, ic, tc), (user, item, ts) = cols, typed
    if invalid is not None:
        chk.reject(invalid, "not_utf8", "a value is not valid UTF-8")
    for a, name in ((user, uc), (item, ic), (ts, tc)):
        null = as_bool(a.is_null())
        # bad times are null too
        chk.reject(null & ~bad_ts if a is ts else null, "missing_value", f"column {name!r} is empty")
    chk.reject(
        bad_ts,
        "bad_timestamp",
        lambda idx: [
            f"column {tc!r}: {v[:40]!r} is not {ts_what}"
            for v in pc.take(raw_time, pa.array(idx)).cast(pa.string()).to_pylist()
        ],
    )
    for a, name in ((user, uc), (item, ic)):
        if pa.types.is_integer(a.type):
            chk.reject(as_bool(pc.less(a, 0)), "negative_id", f"column {name!r}: ids must be >= 0")
        else:
            chk.reject(as_bool(pc.equal(pc.utf8_trim_whitespace(a), "")), "missing_value", f"column {name!r} is blank")


def table_events(
    path: str,
    table: pa.Table,
    cols: tuple[str, str, str],
    line: np.ndarray,
    rejects: list,
    invalid: "np.ndarray | None",
    is_csv: bool,
    calls: "list[int] | None" = None,
    kinds: CsvKinds | None = None,
) -> tuple[dict, list, dict]:
    """One file's (or one batch's) typed events and rejects. `calls`, when given, receives for
    each reject table added the number of the check that made it (a batched reader restores
    the whole file's reject order from them); `kinds`: a CSV part's (see CsvKinds)."""
    uc, ic, tc = cols
    raw = [table.column(c).combine_chunks() for c in cols]
    n = table.num_rows
    blank = np.zeros(n, bool)
    kt = None
    if is_csv:
        assert invalid is not None  # _read_csv says of every row whether it is UTF-8
        raw, blank, kt = _csv_strings(raw, invalid, kinds)
    user = as_id(raw[0], path, uc)
    item = as_id(raw[1], path, ic)
    ts, bad_ts, ts_what = as_time(raw[2], path, tc, kt)
    skipped = sum(r.num_rows for r in rejects)  # rows the CSV reader rejected
    chk = _RowChecks(path, user, line, blank.copy(), rejects, calls)
    _check_rows(chk, cols, (user, item, ts), raw[2], bad_ts, ts_what, invalid)
    keep = ~chk.bad
    take = pa.array(np.flatnonzero(keep))
    out = {
        "user": user if keep.all() else pc.take(user, take),
        "item": item if keep.all() else pc.take(item, take),
        "ts": pc.fill_null(ts, 0).to_numpy()[keep],
        "line": line[keep],
    }
    return out, rejects, {"lines": n + skipped, "blank_lines": int(blank.sum())}


def streamable(dataset: pds.Dataset, cols: tuple[str, str, str]) -> bool:
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


def parquet_dataset(path: str, user_col: str, item_col: str, time_col: str, defaults: bool) -> tuple:
    try:
        dataset = pds.dataset(path, format="parquet")
        return dataset, event_cols(dataset.schema.names, user_col, item_col, time_col, defaults, path)
    except (OSError, ValueError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise
        raise _not_parquet(path, e) from None


def parquet_spans(path: str, cols: tuple[str, str, str, bool], rows: int, most: int) -> list[dict]:
    """A Parquet input's row groups, in reading order, cut into spans of about `rows` rows (at
    most `most` spans): [{"rows": rows before it, "groups": [[file, first group, end], ...]}];
    [{}] (read whole) where that makes one span, where it is not streamable, or where its row
    groups cannot be listed (reading it whole then says why)."""
    dataset, names = parquet_dataset(path, *cols)
    if not streamable(dataset, names):
        return [{}]
    try:
        groups = [(f.path, g.id, g.num_rows) for f in dataset.get_fragments() for g in f.row_groups]
    except (OSError, ValueError):
        return [{}]
    total = sum(n for _, _, n in groups)
    size = max(rows, -(-total // most))
    if total < 2 * size:
        return [{}]
    spans: list[dict] = []
    done = 0
    for f, g, n in groups:
        if not spans or done >= len(spans) * size:
            spans.append({"rows": done, "groups": []})
        runs = spans[-1]["groups"]
        if runs and runs[-1][0] == f and runs[-1][2] == g:
            runs[-1][2] = g + 1
        else:
            runs.append([f, g, g + 1])
        done += n
    return spans if len(spans) > 1 else [{}]


def span_dataset(path: str, dataset: pds.Dataset, groups: list) -> pds.Dataset:
    """The row groups `groups` (parquet_spans) of a Parquet input, as a dataset of their own."""
    frags = {f.path: f for f in dataset.get_fragments()}
    if any(f not in frags for f, _, _ in groups):
        raise DataprepError(f"{path}: its files changed while the build read them; run the build again")
    parts = [frags[f].subset(row_group_ids=list(range(a, b))) for f, a, b in groups]
    return pds.FileSystemDataset(parts, dataset.schema, dataset.format, dataset.filesystem)


def parquet_batches(
    path: str, dataset: pds.Dataset, cols: tuple, batch_rows: int, first_row: "int | None" = None
) -> Iterator[tuple]:
    """The events of `dataset` (a Parquet input, or a span of it from row `first_row` on) in batches."""
    rows = first_row or 0
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
            raise _not_parquet(name, e) from None
        if batch is None:
            break
        if batch.num_rows == 0:
            continue
        line = np.arange(rows + 1, rows + batch.num_rows + 1, dtype=np.int64)
        calls: list[int] = []
        out, rejects, counts = table_events(
            path, pa.Table.from_batches([batch]), cols, line, [], None, False, calls=calls
        )
        rows += batch.num_rows
        yield out, list(zip(calls, rejects, strict=True)), counts
    if rows == 0 and first_row is None:
        raise DataprepError(f"{path}: no rows; nothing to read (give a file with interactions)")
