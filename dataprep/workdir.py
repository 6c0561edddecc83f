"""The bucketed build's work folder: each stage's outputs are a folder written whole or not at
all (task_dir), so a stage re-run by a retry rewrites only its own outputs."""

import contextlib
import json
import os
import resource
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from dataprep.errors import DataprepError


def ctx(work: Path) -> dict:
    """The build's settings, written once by the driver (inputs, format, config, budget)."""
    return json.loads((work / "ctx.json").read_text())


def meta(d: Path) -> dict:
    """A stage output's figures."""
    return json.loads((d / "meta.json").read_text())


def read_ids(work: Path, name: str) -> pa.Array:
    """The sorted raw user or item ids of the ids stage (index = dense id - 1)."""
    return read_ipc(work / "ids" / f"{name}.arrow").column("id").combine_chunks()


SEQ = ("offsets", "values", "items", "length", "ts")  # a bucket's sequence arrays, one .npy each


def seq(work: Path, b: int) -> dict[str, np.ndarray]:
    """Bucket b's sequence arrays (offsets, values, items, length, and ts where times exist), memory-mapped."""
    d = work / "bucket" / str(b)
    return {k: np.load(d / f"{k}.npy", mmap_mode="r") for k in SEQ if (d / f"{k}.npy").exists()}


EVENTS = "events"  # a scanned span's events, one IPC stream file per batch, in order
LINES = "lines.bin"  # a scanned span's event line numbers, where they do not run on by one


def event_parts(work: Path, f: int) -> list[Path]:
    """Scanned span f's event files, in order."""
    return sorted((work / "scan" / str(f) / EVENTS).glob("*.arrow"))


def event_lines(work: Path, f: int, ev: np.ndarray) -> np.ndarray:
    """The input line (or row) numbers of span f's events `ev` (0-based indices in its scan)."""
    d = work / "scan" / str(f)
    if (d / LINES).exists():
        return np.asarray(np.memmap(d / LINES, np.int64, mode="r")[ev])
    return ev + meta(d)["line0"]


def spent(work: Path, stage: str, i: int) -> None:
    """Remove the work files that only task i of `stage` reads, once it is done (a one-process
    build: their pages in the page cache are reused, not new ones taken; Airflow keeps them for
    retries). The small files finish reads (ids, rejects, metas) stay. (split removes its
    input files one by one as it goes, where ctx "drop_inputs" says so.)"""
    if stage == "split":
        shutil.rmtree(work / "scan" / str(i) / EVENTS, ignore_errors=True)
        return
    elif stage == "bucket":
        paths = list(work.glob(f"split/*/b{i}.arrow"))
    elif stage == "route":
        paths = [work / "bucket" / str(i) / f"{k}.npy" for k in SEQ]
    elif stage == "write":
        paths = list(work.glob(f"route/*/r{i}.arrow"))
    elif stage == "write_eval":
        paths = list(work.glob("route/*/eval.arrow"))
    else:
        return
    for p in paths:
        p.unlink(missing_ok=True)


def scan_rejects(work: Path) -> list[pa.Table]:
    """Every input file's reader rejects, file after file, each check's table in check order
    (a file's spans' tables of one check concatenated, in order)."""
    out: list[pa.Table] = []
    by_check: dict[int, list[pa.Table]] = {}
    spans = ctx(work)["spans"]
    for s, span in enumerate(spans):
        p = work / "scan" / str(s) / "rejects.arrow"
        if p.exists():
            for check, t in zip(meta(p.parent)["checks"], batches_ipc(p), strict=True):
                by_check.setdefault(check, []).append(t)
        if s + 1 == len(spans) or spans[s + 1]["file"] != span["file"]:  # the file's last span
            out += [pa.concat_tables(by_check[c]).combine_chunks() for c in sorted(by_check)]
            by_check = {}
    return out


KILL_ENV = "FTREC_DATAPREP_KILL"  # "bucket/1": that stage's process kills itself once, half-written (retries)


def _fault(target: Path, tmp: Path) -> None:
    """An injected fault for retry drills: SIGKILL this process once, with `tmp` half-written."""
    want = os.environ.get(KILL_ENV)
    if want and target.parts[-2:] == tuple(want.split("/")):
        marker = target.parent / f".killed-{target.name}"
        if not marker.exists():
            marker.touch()
            (tmp / "partial").write_bytes(b"\0" * 1024)
            os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def task_dir(target: Path) -> Iterator[Path]:
    """A fresh folder that replaces `target` whole when the block ends without an exception."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir()
    try:
        _fault(target, tmp)
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def open_files(n: int) -> None:
    """Room for `n` more open files in this process (write(r) holds one per bucket, and a
    one-process build runs two such tasks at once): the soft limit raised as far as the hard
    one allows, else a DataprepError that says what to change."""
    need = 2 * n + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise DataprepError(
                f"writing a rank file reads {n} bucket files at once, and this process may open only {hard} "
                f"files (ulimit -n); raise the limit to {need} or give a larger --memory-budget (fewer buckets)"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def write_ipc(path: Path, table: pa.Table, rows: int | None = None) -> None:
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=rows)


def read_ipc(path: Path) -> pa.Table:
    """An IPC file's table, memory-mapped: its buffers are the page cache's, not copies."""
    with pa.memory_map(str(path)) as f:
        return pa.ipc.open_file(f).read_all()


def batches_ipc(path: Path) -> list[pa.Table]:
    """An IPC file's record batches, each as a one-chunk table (memory-mapped)."""
    with pa.memory_map(str(path)) as f:
        r = pa.ipc.open_file(f)
        return [pa.Table.from_batches([r.get_batch(i)]) for i in range(r.num_record_batches)]


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj))


def took(work: Path, name: str, index: "int | None", seconds: float) -> None:
    """Record the seconds a stage task took (a fanned-out build's manifest timings sum them)."""
    d = work / "took"
    d.mkdir(exist_ok=True)
    (d / f"{name}-{index}").write_text(repr(seconds))


class Events:
    """A scanned file's events, one IPC stream file per batch in events/ (split reads them in
    order; a one-process build removes each once split has cut it: its pages are reused for the
    next), and their line numbers (Lines)."""

    def __init__(self, d: Path):
        self.dir, self.lines = d / EVENTS, Lines(d / LINES)
        self.parts, self.schema = 0, None

    def add(self, ev: pa.Table, line: np.ndarray) -> bool:
        """Store a batch; False (nothing stored) when its schema is not the first batch's."""
        if self.schema is None:
            self.schema = ev.schema
            self.dir.mkdir()
        if ev.schema != self.schema:
            return False
        for k in ("user", "item"):  # ids as int32 where they fit: a third fewer bytes (each file its own)
            x = ev.column(k).to_numpy() if pa.types.is_int64(ev.schema.field(k).type) else None
            if x is not None and len(x) and x.min() >= 0 and x.max() < 1 << 31:
                ev = ev.set_column(ev.schema.get_field_index(k), k, pa.array(x.astype(np.int32)))
        with pa.OSFile(str(self.dir / f"{self.parts:06d}.arrow"), "wb") as fo, pa.ipc.new_stream(fo, ev.schema) as w:
            w.write_table(ev)
        self.parts += 1
        self.lines.add(np.asarray(line, np.int64))
        return True


class Lines:
    """A file's event line numbers: none stored while they run on by one from the first (`first`,
    the usual case), else every event's in `path` (raw int64; see event_lines)."""

    def __init__(self, path: Path):
        self.path, self.first, self.n = path, 0, 0
        self.out: BinaryIO | None = None

    def add(self, line: np.ndarray) -> None:
        if self.n == 0 and self.out is None:
            self.first = int(line[0])
        if self.out is None and np.array_equal(line, np.arange(self.first + self.n, self.first + self.n + len(line))):
            self.n += len(line)
            return
        if self.out is None:
            self.out = open(self.path, "wb")  # closed by close()
            for a in range(0, self.n, 1 << 20):  # the lines so far ran on by one
                np.arange(self.first + a, self.first + min(a + (1 << 20), self.n), dtype=np.int64).tofile(self.out)
        line.tofile(self.out)

    def close(self) -> None:
        if self.out is not None:
            self.out.close()
