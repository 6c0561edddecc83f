"""Event tables (CSV or Parquet with user, item and time columns) -> typed events and rejects.

CSV is read as strings and typed here, so one bad row costs that row; Parquet's typed
columns are used as they are, and a file pyarrow cannot read is an error naming it."""

import csv
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.dataset as pds

from dataprep.errors import DataprepError
from dataprep.readers.values import as_bool, as_id, as_time, csv_ids, matches, rejected_rows


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


def _csv_header(path: str, delimiter: str) -> list[str]:
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
                f"{path}: cannot read as CSV events ({str(e).splitlines()[0]}); check --format and the file"
            ) from None
        return t, bad, True
    finally:
        sys.unraisablehook = hook


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
    rejects = []
    for reason in ("malformed_line", "not_utf8"):
        rows = [r for r in bad if ("\ufffd" in r.text) == (reason == "not_utf8")]
        if rows:
            rejects.append(
                rejected_rows(
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


def _not_parquet(name: str, e: Exception) -> DataprepError:
    """The error for a Parquet file pyarrow cannot read (`e`: pyarrow's reason)."""
    return DataprepError(
        f"{name}: not a readable Parquet file ({str(e).splitlines()[0]}); it may be "
        "truncated, still being written or not Parquet; check the file and --format"
    )


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
        raise _not_parquet(name, e) from None


def _parquet_readable(f: str) -> bool:
    try:
        pds.dataset(f, format="parquet").to_table()
        return True
    except (OSError, ValueError):
        return False


def read_events(path: str, user_col: str, item_col: str, time_col: str, defaults: bool) -> tuple[dict, list, dict]:
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


def _csv_strings(raw: list[pa.Array], invalid: np.ndarray) -> tuple[list[pa.Array], np.ndarray]:
    """CSV strings trimmed, "" as missing, values of rows that are not UTF-8 dropped (they must not
    make a column text), ids typed; and the blank rows (none of the three values)."""
    drop = pa.array(invalid)
    raw = [
        pc.if_else(pc.or_kleene(pc.equal(a, ""), drop), pa.scalar(None, pa.string()), a)
        for a in (pc.utf8_trim_whitespace(a) for a in raw)
    ]
    blank = np.logical_and.reduce([as_bool(a.is_null()) for a in raw]) & ~invalid
    return [csv_ids(raw[0]), csv_ids(raw[1]), raw[2]], blank


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
) -> tuple[dict, list, dict]:
    """One file's (or one batch's) typed events and rejects. `calls`, when given, receives for
    each reject table added the number of the check that made it (a batched reader restores
    the whole file's reject order from them)."""
    uc, ic, tc = cols
    raw = [table.column(c).combine_chunks() for c in cols]
    n = table.num_rows
    blank = np.zeros(n, bool)
    if is_csv:
        assert invalid is not None  # _read_csv says of every row whether it is UTF-8
        raw, blank = _csv_strings(raw, invalid)
    user = as_id(raw[0], path, uc)
    item = as_id(raw[1], path, ic)
    ts, bad_ts, ts_what = as_time(raw[2], path, tc)
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
        return dataset, _event_cols(dataset.schema.names, user_col, item_col, time_col, defaults, path)
    except (OSError, ValueError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise
        raise _not_parquet(path, e) from None


def parquet_batches(path: str, dataset: pds.Dataset, cols: tuple, batch_rows: int) -> Iterator[tuple]:
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
    if rows == 0:
        raise DataprepError(f"{path}: no rows; nothing to read (give a file with interactions)")
