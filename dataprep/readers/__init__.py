"""Readers: raw interaction files -> one columnar table of (user, item, time) events.

One module per kind of input (`text`: sasrec, iclrec, movielens .dat; `events`: CSV and
Parquet tables); `values` types ids and times. Bad rows become rejects; a problem with a
whole file (missing, empty, missing column, unreadable) raises DataprepError naming the file
and what to do. Formats and reject reasons: docs/dataprep.md.
"""

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from dataprep.errors import DataprepError
from dataprep.readers.events import (
    CSV_SUFFIXES,
    iter_csv,
    parquet_batches,
    parquet_dataset,
    parquet_spans,
    read_events,
    span_dataset,
    streamable,
)
from dataprep.readers.text import read_sasrec, token_events

FORMATS = ("sasrec", "iclrec", "movielens", "events")
SPAN_ROWS = 1 << 20  # rows a span of a Parquet input holds at least (spans: the bucketed build's reads)
MOST_SPANS = 64  # spans of one input at most (each is a task, and a file per bucket in split)
TIME_FORMATS = ("movielens", "events")  # real event times; the others order by input position


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
    if is_uri(path) and (fmt != "events" or path.endswith(CSV_SUFFIXES)):
        raise DataprepError(
            f"{path}: only Parquet events are read from a URI (--format events); copy other files to a local folder"
        )
    if fmt == "sasrec":
        return read_sasrec(path)
    if fmt == "iclrec":
        return token_events(path, None, "iclrec")
    if fmt == "movielens":
        if path.endswith(".csv"):
            return read_events(path, "userId", "movieId", "timestamp", False)
        return token_events(path, "::", "movielens")
    return read_events(path, user_col, item_col, time_col, defaults)


def iter_file(
    path: str,
    fmt: str,
    batch_rows: int,
    *,
    user_col: str = "user_id",
    item_col: str = "item_id",
    time_col: str = "timestamp",
    kinds: tuple[str, str, str] | None = None,
    replace: bool = False,
    span: dict | None = None,
    **unknown,
) -> Iterator[tuple[dict, list[tuple[int, pa.Table]], dict]]:
    """One input file (or a `span` of it, see spans) as parts of at most `batch_rows` rows where
    the format allows (Parquet and CSV events), else whole: (event columns, [(check number,
    reject table)], counts). The parts' events concatenate to `read_file`'s; its rejects are
    each check's tables concatenated, in check order (see table_events). A CSV file may raise
    events.Restart: read it again with the Restart's `kinds` and `replace`."""
    defaults = _columns(user_col, item_col, time_col, unknown)
    csv = path.endswith(CSV_SUFFIXES)
    if csv and not is_uri(path) and (fmt == "events" or fmt == "movielens" and path.endswith(".csv")):
        check_input(path)
        names = (
            (user_col, item_col, time_col, defaults) if fmt == "events" else ("userId", "movieId", "timestamp", False)
        )
        yield from iter_csv(path, *names, batch_rows, kinds, replace)
        return
    parquet = fmt == "events" and not csv
    if parquet:
        check_input(path)
        dataset, cols = parquet_dataset(path, user_col, item_col, time_col, defaults)
        if span:
            part = span_dataset(path, dataset, span["groups"])
            yield from parquet_batches(path, part, cols, batch_rows, span["rows"])
            return
        if streamable(dataset, cols):
            yield from parquet_batches(path, dataset, cols, batch_rows)
            return
    cols_, rejects, counts = read_file(path, fmt, user_col, item_col, time_col, defaults)
    yield cols_, list(enumerate(rejects)), counts


def spans(
    paths: list[str],
    fmt: str,
    *,
    user_col: str = "user_id",
    item_col: str = "item_id",
    time_col: str = "timestamp",
    **unknown,
) -> list[dict]:
    """The bucketed build's units of reading, in input order: {"file": index in `paths`}, read
    whole, or with "rows" and "groups" where a Parquet input is cut into runs of its row groups
    (events.parquet_spans: SPAN_ROWS rows at least, MOST_SPANS a file at most), which are read
    at once. Reading them in order reads the inputs' rows in order."""
    cols = (user_col, item_col, time_col, _columns(user_col, item_col, time_col, unknown))
    out = []
    for f, path in enumerate(paths):
        cut = fmt == "events" and not path.endswith(CSV_SUFFIXES)
        out += [{"file": f, **s} for s in (parquet_spans(path, cols, SPAN_ROWS, MOST_SPANS) if cut else [{}])]
    return out


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
