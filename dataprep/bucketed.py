"""The bucketed build: the in-memory build's shard set, byte for byte, in memory bounded by a bucket.

Stages over a work folder inside the set's staging folder. Each is a function of (work, index)
whose outputs are files written whole or not at all, so it runs in this process, in a process
pool (`--workers`) or as an Airflow task, and a re-run rewrites only its own outputs:

  scan(f)    read input file f in batches: its parsed events, ids with event counts, rejects
  ids()      all files' ids: sorted unique users and items (the dense-id order); bucket bounds
  split(f)   file f's events into the B buckets, by user
  bucket(b)  bucket b's users grouped, ordered, de-duplicated and filtered (build_sequences)
  plan()     item map, time unit and every sample's cost -> the one balance plan
  route(b)   bucket b's eval rows and samples, the samples sorted into one piece per rank
  write(r)   rank r's shard file, step by step from the B pieces
  finish()   eval, maps and the rejects, in the in-memory build's order

Buckets are ranges of the sorted user ids cut at about equal event counts, not hashes: dense
user ids, eval rows and sample ids follow the sorted user order, so each output streams bucket
after bucket. What the in-memory build decides over all events is decided here over all files
or buckets: ids numbered in sorted raw order (items among those kept), ties in input order
(events carry their global index), the time unit from the largest kept time, one seeded plan
over all samples' costs, and each reject table in the same order with the same rows.
"""

import contextlib
import json
import math
import os
import re
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dataprep import readers, schema, sequences
from dataprep.cost import load_cost_model
from dataprep.errors import DataprepError

BYTES_PER_EVENT = 400  # peak working set of a bucket per event (build_sequences + samples), measured
IN_MEMORY_BYTES_PER_EVENT = 130  # the in-memory build's peak per event (10M Parquet events: 1.15 GB)
ROW_GROUP_ROWS = 1 << 20  # pq.write_table's row groups: eval and maps are written in the same ones
PIECE_ROWS = 16_384  # rows per record batch of a rank piece at most (write(r) holds one per bucket)
MIN_BATCH_ROWS = 1 << 16  # rows per batch read from Parquet, at least
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: "str | int") -> int:
    """'512MB', '4GB', '1.5G', '800M' or a number of bytes -> bytes (K, M, G, T are powers of 1024)."""
    if isinstance(text, int):
        n = text
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise DataprepError(f"--memory-budget {text!r}: not a size; write it like 512MB or 4GB")
        n = int(float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower()))
    if n < 64 << 20:
        raise DataprepError(f"--memory-budget {text!r}: below 64MB; give at least 64MB")
    return n


def default_budget() -> int:
    """A quarter of the machine's memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def estimate(paths: list[str], fmt: str) -> int:
    """Bytes the in-memory build would need for these inputs (events from Parquet metadata, else
    from the file size at ~8 bytes a text line)."""
    total = 0
    for p in paths:
        if readers.is_uri(p):
            import pyarrow.dataset as pds

            total += pds.dataset(p, format="parquet").count_rows()
            continue
        files = [str(f) for f in sorted(Path(p).rglob("*")) if f.is_file()] if Path(p).is_dir() else [p]
        for f in files:
            try:
                rows = pq.ParquetFile(f).metadata.num_rows if fmt == "events" else None
            except (OSError, ValueError):
                rows = None
            total += rows if rows is not None else os.path.getsize(f) // 8
    return total * IN_MEMORY_BYTES_PER_EVENT


# ---------------------------------------------------------------- files of the work folder


def _ctx(work: Path) -> dict:
    return json.loads((work / "ctx.json").read_text())


def _meta(d: Path) -> dict:
    return json.loads((d / "meta.json").read_text())


KILL_ENV = "FTREC_DATAPREP_KILL"  # "bucket/1": that stage's process kills itself once, half-written (retry tests)


def _fault(target: Path, tmp: Path) -> None:
    """The retry tests' fault: SIGKILL this process once, with `tmp` half-written."""
    want = os.environ.get(KILL_ENV)
    if want and target.parts[-2:] == tuple(want.split("/")):
        marker = target.parent / f".killed-{target.name}"
        if not marker.exists():
            marker.touch()
            (tmp / "partial").write_bytes(b"\0" * 1024)
            os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def _task_dir(target: Path) -> Iterator[Path]:
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


def _write_ipc(path: Path, table: pa.Table, rows: int | None = None) -> None:
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=rows)


def _read_ipc(path: Path) -> pa.Table:
    with pa.OSFile(str(path)) as f:
        return pa.ipc.open_file(f).read_all()


def _batches_ipc(path: Path) -> list[pa.Table]:
    """An IPC file's record batches, each as a one-chunk table."""
    with pa.OSFile(str(path)) as f:
        r = pa.ipc.open_file(f)
        return [pa.Table.from_batches([r.get_batch(i)]) for i in range(r.num_record_batches)]


def _json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj))


# ---------------------------------------------------------------- stages


def scan(work: "str | Path", f: int) -> dict:
    """Read input file f: events (raw ids; times, or input positions), ids, counts, rejects."""
    work = Path(work)
    ctx = _ctx(work)
    path = ctx["paths"][f]
    counts: dict[str, int] = {}
    groups: dict[int, list[pa.Table]] = {}
    users: list[pa.Table] = []
    items: list[pa.Array] = []
    types: dict[str, set[str]] = {"user": set(), "item": set()}
    n = 0
    with _task_dir(work / "scan" / str(f)) as d:
        writer = None
        for cols, rejects, c in readers.iter_file(path, ctx["fmt"], ctx["batch_rows"], **ctx["reader_options"]):
            for k, v in c.items():
                counts[k] = counts.get(k, 0) + v
            for tag, t in rejects:
                groups.setdefault(tag, []).append(t)
            ev = pa.table({k: _arrow(cols[k]) for k in ("user", "item", "ts", "line")})
            for k in types:
                types[k].add(str(ev.schema.field(k).type))
            if ev.num_rows == 0:
                continue
            if writer is None:
                writer, first = pa.ipc.new_stream(str(d / "events.arrow"), ev.schema), ev.schema
            if ev.schema != first:  # a later part typed its ids otherwise: keep all as text
                raise DataprepError(f"{path}: id columns change type inside the file; store one type per column")
            writer.write_table(ev)
            n += ev.num_rows
            vc = pc.value_counts(ev.column("user").combine_chunks()).flatten()
            users.append(pa.table({"u": vc[0], "n": vc[1]}))
            items.append(pc.unique(ev.column("item").combine_chunks()))
            if len(users) >= 16:
                users, items = [_sum_counts(users)], [pc.unique(pa.concat_arrays(items))]
        if writer is not None:
            writer.close()
        if users:
            _write_ipc(d / "users.arrow", _sum_counts(users))
            _write_ipc(d / "items.arrow", pa.table({"i": pc.unique(pa.concat_arrays(items))}))
        rej = [pa.concat_tables(groups[k]).combine_chunks() for k in sorted(groups)]
        if rej:
            with pa.OSFile(str(d / "rejects.arrow"), "wb") as fo, pa.ipc.new_file(fo, rej[0].schema) as w:
                for t in rej:
                    w.write_table(t)
        _json(
            d / "meta.json",
            {"counts": counts, "events": n, "rejected": sum(t.num_rows for t in rej), "types": _typenames(types)},
        )
    return {"file": path, "events": n}


def _arrow(a: "pa.Array | np.ndarray") -> pa.Array:
    return a if isinstance(a, pa.Array) else pa.array(np.ascontiguousarray(a, dtype=np.int64))


def _typenames(types: dict[str, set[str]]) -> dict[str, str]:
    return {k: (v.pop() if len(v) == 1 else "string") for k, v in types.items()}


def _sum_counts(parts: list[pa.Table]) -> pa.Table:
    t = pa.concat_tables(parts).group_by("u").aggregate([("n", "sum")])
    return pa.table({"u": t.column("u"), "n": t.column("n_sum")})


def ids(work: "str | Path", budget: int, buckets: int | None) -> dict:
    """Merge the files' ids: users and items sorted (dense-id order), B buckets of users."""
    work = Path(work)
    ctx = _ctx(work)
    paths = ctx["paths"]
    metas = [_meta(work / "scan" / str(f)) for f in range(len(paths))]
    lines = sum(m["counts"].get("lines", 0) for m in metas)
    if sum(m["rejected"] for m in metas) > ctx["max_reject_fraction"] * max(lines, 1):
        from dataprep.build import check_rejects

        check_rejects(_read_rejects(work, len(paths)), lines, ctx["max_reject_fraction"])
    events = sum(m["events"] for m in metas)
    if events == 0:
        raise DataprepError(
            f"{', '.join(paths)}: no valid interactions left after rejecting bad rows; "
            "check --format and the rejects listed above"
        )
    typ = {k: pa.string() if any(m["types"][k] == "string" for m in metas) else pa.int64() for k in ("user", "item")}
    have = [work / "scan" / str(f) for f in range(len(paths)) if metas[f]["events"]]
    uparts = [_read_ipc(d / "users.arrow") for d in have]
    users = _sum_counts([pa.table({"u": t.column("u").cast(typ["user"]), "n": t.column("n")}) for t in uparts])
    users = users.sort_by("u")
    items = pc.unique(
        pa.concat_arrays([_read_ipc(d / "items.arrow").column("i").cast(typ["item"]).combine_chunks() for d in have])
    )
    items = pc.take(items, pc.sort_indices(items))
    cum = np.cumsum(users.column("n").to_numpy())
    b = buckets or max(1, math.ceil(events * BYTES_PER_EVENT / budget))
    b = min(b, users.num_rows)
    starts = np.unique(np.searchsorted(cum, events * np.arange(b) / b, side="right")).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum([m["events"] for m in metas])]).tolist()
    with _task_dir(work / "ids") as d:
        _write_ipc(d / "users.arrow", pa.table({"id": users.column("u").combine_chunks()}))
        _write_ipc(d / "items.arrow", pa.table({"id": items}))
        np.save(d / "starts.npy", starts)
        counts = {k: sum(m["counts"].get(k, 0) for m in metas) for k in ("lines", "blank_lines")}
        meta = {
            "buckets": len(starts),
            "offsets": offsets,
            "users": users.num_rows,
            "counts": {**counts, "events_read": events, "rows_rejected": sum(m["rejected"] for m in metas)},
        }
        _json(d / "meta.json", meta)
    return meta


def _read_rejects(work: Path, files: int) -> list[pa.Table]:
    out = []
    for f in range(files):
        p = work / "scan" / str(f) / "rejects.arrow"
        if p.exists():
            out += _batches_ipc(p)
    return out


def _lookup(sorted_ids: pa.Array) -> Callable[[pa.Array], np.ndarray]:
    """raw id -> its index in `sorted_ids` (every id looked up is there)."""
    if pa.types.is_integer(sorted_ids.type):
        keys = sorted_ids.to_numpy()
        lo = int(keys[0]) if len(keys) else 0
        span = int(keys[-1]) - lo + 1 if len(keys) else 0
        if span <= 4 * len(keys) + (1 << 20):  # dense enough: a table indexed by id (O(1) a lookup)
            table = np.zeros(span, np.int64 if len(keys) >= 1 << 31 else np.int32)
            table[keys - lo] = np.arange(len(keys))
            return lambda a: table[a.cast(pa.int64()).to_numpy() - lo].astype(np.int64)
        return lambda a: np.searchsorted(keys, a.cast(pa.int64()).to_numpy())
    return lambda a: pc.index_in(a.cast(pa.string()), value_set=sorted_ids).to_numpy().astype(np.int64)


def _ids(work: Path, name: str) -> pa.Array:
    return _read_ipc(work / "ids" / f"{name}.arrow").column("id").combine_chunks()


def split(work: "str | Path", f: int) -> dict:
    """File f's events -> one piece per bucket: global event index, user and item codes, time, line."""
    work = Path(work)
    ctx, idm = _ctx(work), _meta(work / "ids")
    starts = np.load(work / "ids" / "starts.npy")
    user_code, item_code = _lookup(_ids(work, "users")), _lookup(_ids(work, "items"))
    off, pos = idm["offsets"][f], 0
    src = work / "scan" / str(f) / "events.arrow"
    with _task_dir(work / "split" / str(f)) as d:
        writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}
        if src.exists():
            with pa.OSFile(str(src)) as fi:
                for batch in pa.ipc.open_stream(fi):
                    n = batch.num_rows
                    u = user_code(batch.column("user"))
                    ts = batch.column("ts").to_numpy()
                    t = pa.table(
                        {
                            "ev": np.arange(off + pos, off + pos + n, dtype=np.int64),
                            "u": u,
                            "i": item_code(batch.column("item")),
                            "ts": ts if ctx["has_time"] else ts + off,
                            "line": batch.column("line").to_numpy(),
                        }
                    )
                    pos += n
                    b = np.searchsorted(starts, u, side="right") - 1
                    order = np.argsort(b, kind="stable")
                    cuts = np.searchsorted(b[order], np.arange(len(starts) + 1))
                    t = t.take(pa.array(order))
                    for k in np.flatnonzero(np.diff(cuts)).tolist():
                        if k not in writers:
                            writers[k] = pa.ipc.new_file(str(d / f"b{k}.arrow"), t.schema)
                        writers[k].write_table(t.slice(cuts[k], cuts[k + 1] - cuts[k]))
        for w in writers.values():
            w.close()
    return {"file": f, "events": pos}


def bucket(work: "str | Path", b: int) -> dict:
    """Bucket b's sequences, as build_sequences makes them, items as global codes, raw times."""
    work = Path(work)
    t0 = time.monotonic()
    ctx, idm = _ctx(work), _meta(work / "ids")
    starts = np.load(work / "ids" / "starts.npy")
    lo = int(starts[b])
    parts, src = [], []
    for f in range(len(ctx["paths"])):
        p = work / "split" / str(f) / f"b{b}.arrow"
        if p.exists():
            parts.append(_read_ipc(p))
            src.append(np.full(parts[-1].num_rows, f, np.int32))
    t = pa.concat_tables(parts)
    col = {k: t.column(k).to_numpy() for k in t.column_names}
    del t, parts
    hi = int(starts[b + 1]) if b + 1 < len(starts) else idm["users"]
    users = _ids(work, "users").slice(lo, hi - lo)
    ev = readers.Interactions(
        user=users.take(pa.array(col["u"] - lo)),
        item=pa.array(col["i"]),
        ts=col["ts"],
        source=np.concatenate(src),
        line=col["line"],
        paths=ctx["paths"],
        has_time=ctx["has_time"],
    )
    ev_index = col.pop("ev")
    del col
    c = ctx["config"]
    seq = sequences.build_sequences(ev, dedup=c["dedup"], max_events=c["max_events"], raw_times=True, part=True)
    return _save_bucket(work, b, seq, ev_index, len(ev), time.monotonic() - t0)


def _save_bucket(work: Path, b: int, seq: sequences.Sequences, ev_index: np.ndarray, n: int, took: float) -> dict:
    max_len = _ctx(work)["config"]["max_len"]
    tl = np.diff(seq.offsets) - 2
    tl = tl[tl >= 2]
    length = np.minimum(tl - 1, max_len).astype(np.int32)
    with _task_dir(work / "bucket" / str(b)) as d:
        arrays = {"offsets": seq.offsets, "values": seq.values, "items": seq.item_raw.to_numpy(), "length": length}
        if seq.timestamps is not None:
            arrays["ts"] = seq.timestamps
        np.savez(d / "seq.npz", **arrays)
        _write_ipc(d / "users.arrow", pa.table({"id": seq.user_raw}))
        short = 0
        for r in seq.rejects:
            reason = r.column("reason")[0].as_py()
            if reason == "duplicate_event":
                assert seq.duplicate_events is not None
                r = r.append_column("ev", pa.array(ev_index[seq.duplicate_events]))
            short += r.num_rows if reason == "too_short" else 0
            _write_ipc(d / f"rejects-{reason}.arrow", r)
        ts = seq.timestamps
        meta = {
            **seq.counts,
            "num_users": seq.num_users,
            "samples": len(length),
            "too_short": short,
            "max_abs_ts": int(np.abs(ts).max()) if ts is not None and len(ts) else 0,
            "truncated": int((tl - 1 > max_len).sum()),
            "items_truncated": int(np.maximum(tl - 1 - max_len, 0).sum()),
            "events": n,
            "seconds": round(took, 3),
        }
        _json(d / "meta.json", meta)
    return {"bucket": b, **meta}


def plan(work: "str | Path", buckets: int, say: Callable[[str], None], timings: dict[str, float]) -> dict:
    """The item map, the time unit and the balance plan over every bucket's samples."""
    from dataprep.build import _balance

    work = Path(work)
    ctx = _ctx(work)
    metas = [_meta(work / "bucket" / str(b)) for b in range(buckets)]
    paths = ctx["paths"]
    if sum(m["events_used"] for m in metas) == 0:
        raise DataprepError(
            f"{', '.join(paths)}: no user has the {sequences.MIN_EVENTS} events leave-one-out needs "
            f"({sum(m['too_short'] for m in metas)} users too short); give more data"
        )
    present = np.zeros(len(_ids(work, "items")), bool)
    lengths = []
    for b in range(buckets):
        with np.load(work / "bucket" / str(b) / "seq.npz") as z:
            present[z["items"]] = True
            lengths.append(z["length"])
    length = np.concatenate(lengths)
    if len(length) == 0:
        raise DataprepError(
            f"{', '.join(paths)}: no user has the 4 events a training sample needs "
            "(history, target, validation, test); give more data"
        )
    cost = load_cost_model(ctx["config"]["cost_model"])(length)
    p, st, st_random = _balance(cost, ctx["config"], quiet=True, say=say, timings=timings)
    with _task_dir(work / "plan") as d:
        np.save(d / "dense_items.npy", np.cumsum(present))
        np.save(d / "step.npy", p.step)
        np.save(d / "rank.npy", p.rank)
        np.save(d / "present.npy", present)
        meta = {
            "users": np.concatenate([[0], np.cumsum([m["num_users"] for m in metas])]).tolist(),
            "samples": np.concatenate([[0], np.cumsum([m["samples"] for m in metas])]).tolist(),
            "unit": sequences.time_unit(max(m["max_abs_ts"] for m in metas)) if ctx["has_time"] else "",
            "steps": p.steps,
            "dropped": p.dropped,
            "filled": p.filled,
            "stats": st,
            "bubble_fraction_random": st_random["bubble_fraction"],
            "total_cost": float(cost[p.step >= 0].sum()),
            "tokens": int(length.sum()),
            "num_items": int(present.sum()),
        }
        _json(d / "meta.json", meta)
    return meta


def route(work: "str | Path", b: int) -> dict:
    """Bucket b's eval rows, tail rejects, and its samples as one piece per rank, by step."""
    work = Path(work)
    ctx, pm = _ctx(work), _meta(work / "plan")
    c = ctx["config"]
    dense = np.load(work / "plan" / "dense_items.npy", mmap_mode="r")
    with np.load(work / "bucket" / str(b) / "seq.npz") as z:
        arrays = {k: z[k] for k in z.files}
    users = _read_ipc(work / "bucket" / str(b) / "users.arrow").column("id").combine_chunks()
    ts = arrays.get("ts")
    seq = sequences.Sequences(
        offsets=arrays["offsets"],
        values=dense[arrays["items"][arrays["values"] - 1]].astype(np.int32),
        user_raw=users,
        item_raw=pa.array([], pa.int64()),
        timestamps=sequences.in_seconds(ts, pm["unit"]) if ts is not None else None,
    )
    uo, so = pm["users"][b], pm["samples"][b]
    with _task_dir(work / "route" / str(b)) as d:
        et = sequences.eval_table(seq)
        uid = pa.array(np.arange(uo + 1, uo + seq.num_users + 1, dtype=np.int64))
        _write_ipc(d / "eval.arrow", et.set_column(0, et.schema.field(0), uid))
        samples = sequences.train_samples(seq, c["max_len"])
        n = len(samples.user_id)
        step = np.load(work / "plan" / "step.npy", mmap_mode="r")[so : so + n]
        rank = np.load(work / "plan" / "rank.npy", mmap_mode="r")[so : so + n]
        dropped = np.flatnonzero(step < 0)
        if len(dropped):
            from dataprep.build import tail_rejects

            _write_ipc(d / "tail.arrow", tail_rejects(users.take(pa.array(samples.user_id[dropped] - 1)), so + dropped))
        cost = load_cost_model(c["cost_model"])(samples.length)
        # write(r) holds one batch of each bucket's piece: a quarter of the budget for all of them
        row_bytes = 64 + (12 if ts is not None else 4) * c["max_len"]
        rows = int(min(PIECE_ROWS, max(64, ctx["budget"] // 4 // (len(pm["users"]) - 1) // row_bytes)))
        for r in range(c["world_size"]):
            idx = np.flatnonzero((rank == r) & (step >= 0))
            idx = idx[np.argsort(step[idx], kind="stable")]
            _write_ipc(d / f"r{r}.arrow", _shard_rows(samples, idx, so, uo, step, rank, cost), rows)
    return {"bucket": b, "samples": n}


def _shard_rows(samples, idx, so, uo, step, rank, cost) -> pa.Table:
    """The shard rows of samples `idx` of a bucket, as build._write_shards makes them."""
    take = pa.array(idx)
    ts = samples.timestamps
    return pa.table(
        {
            "sample_id": pa.array((so + idx).astype(np.int64)),
            "user_id": pa.array(samples.user_id[idx] + uo),
            "step": pa.array(np.asarray(step[idx])),
            "rank": pa.array(np.asarray(rank[idx])),
            "length": pa.array(samples.length[idx]),
            "cost": pa.array(cost[idx]),
            "items": pc.take(samples.items, take),
            "target": pa.array(samples.target[idx]),
            **({schema.TIMESTAMPS: pc.take(ts, take)} if ts is not None else {}),
        },
        schema=schema.shard_schema(ts is not None),
    )


class _Piece:
    """One bucket's piece of a rank, read a record batch at a time, step after step."""

    def __init__(self, path: Path):
        self.file = pa.OSFile(str(path))
        self.reader = pa.ipc.open_file(self.file)
        self.next = 0
        self.buf: pa.Table | None = None

    def step(self, s: int) -> list[pa.Table]:
        out: list[pa.Table] = []
        while True:
            if self.buf is None or self.buf.num_rows == 0:
                if self.next == self.reader.num_record_batches:
                    return out
                self.buf = pa.Table.from_batches([self.reader.get_batch(self.next)])
                self.next += 1
            k = int(np.searchsorted(self.buf.column("step").to_numpy(), s, side="right"))
            out.append(self.buf.slice(0, k))
            self.buf = self.buf.slice(k)
            if self.buf.num_rows:
                return out


def write(work: "str | Path", r: int) -> dict:
    """Rank r's shard file: row group s = step s's rows of every bucket, in sample-id order."""
    work = Path(work)
    ctx, pm = _ctx(work), _meta(work / "plan")
    buckets = _meta(work / "ids")["buckets"]
    out = work.parent / schema.shard_file(r)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    pieces = [_Piece(work / "route" / str(b) / f"r{r}.arrow") for b in range(buckets)]
    try:
        with pq.ParquetWriter(tmp, schema.shard_schema(ctx["has_time"])) as w:
            for s in range(pm["steps"]):
                w.write_table(pa.concat_tables([t for p in pieces for t in p.step(s)]).combine_chunks())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        for p in pieces:
            p.file.close()
    return {"rank": r}


class _RowGroups:
    """A Parquet file written piece by piece in the row groups pq.write_table gives the whole table."""

    def __init__(self, path: Path, sch: pa.Schema):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.w = pq.ParquetWriter(path, sch)
        self.buf: list[pa.Table] = []
        self.n = 0

    def add(self, t: pa.Table) -> None:
        self.buf.append(t)
        self.n += t.num_rows
        while self.n >= ROW_GROUP_ROWS:
            self._flush(ROW_GROUP_ROWS)

    def _flush(self, k: int) -> None:
        t = pa.concat_tables(self.buf)
        self.w.write_table(t.slice(0, k).combine_chunks())
        rest = t.slice(k)
        self.buf, self.n = ([rest] if rest.num_rows else []), rest.num_rows

    def close(self) -> None:
        if self.n:
            self._flush(self.n)
        self.w.close()


def _write_eval(path: Path, sch: pa.Schema, pieces: list[Path], user_off: list[int]) -> None:
    """eval.parquet from the buckets' pieces, in pq.write_table's row groups, each built by
    copying its rows into arrays allocated once (a row group and one piece in memory, not two)."""
    group: list[tuple[Path, int, int]] = []  # (piece, first row, rows)
    n = 0
    with pq.ParquetWriter(path, sch) as w:
        for b, piece in enumerate(pieces):
            rows, a = user_off[b + 1] - user_off[b], 0
            while a < rows:
                k = min(rows - a, ROW_GROUP_ROWS - n)
                group.append((piece, a, k))
                n, a = n + k, a + k
                if n == ROW_GROUP_ROWS:
                    w.write_table(_gather(group, sch, n))
                    group, n = [], 0
        if group:
            w.write_table(_gather(group, sch, n))


def _gather(group: list[tuple[Path, int, int]], sch: pa.Schema, n: int) -> pa.Table:
    """The rows `group` names, as one table of one-chunk columns (numbers and lists of numbers)."""
    lists = [f.name for f in sch if pa.types.is_list(f.type)]
    total = dict.fromkeys(lists, 0)
    for piece, a, k in group:  # pass 1: how many list values
        with pa.memory_map(str(piece)) as mm:
            t = pa.ipc.open_file(mm).read_all().slice(a, k)
            for c in lists:
                total[c] += int(pc.sum(pc.list_value_length(t.column(c))).as_py() or 0)
    out: dict[str, np.ndarray] = {}
    for f in sch:
        typ = f.type.value_type if f.name in total else f.type
        out[f.name] = np.empty(total.get(f.name, n), typ.to_pandas_dtype())
        if f.name in total:
            out[f.name + "/offsets"] = np.zeros(n + 1, np.int32)
    row, at = 0, dict.fromkeys(lists, 0)
    for piece, a, k in group:  # pass 2: copy
        with pa.memory_map(str(piece)) as mm:
            t = pa.ipc.open_file(mm).read_all().slice(a, k).combine_chunks()
            for f in sch:
                col = t.column(f.name).chunk(0) if t.num_rows else pa.array([], f.type)
                if f.name not in total:
                    out[f.name][row : row + k] = col.to_numpy()
                    continue
                vals = pc.list_flatten(col).to_numpy()
                lens = pc.list_value_length(col).to_numpy()
                out[f.name][at[f.name] : at[f.name] + len(vals)] = vals
                out[f.name + "/offsets"][row + 1 : row + k + 1] = at[f.name] + np.cumsum(lens)
                at[f.name] += len(vals)
            del t, col
        row += k
    cols = {
        f.name: pa.ListArray.from_arrays(pa.array(out[f.name + "/offsets"]), pa.array(out[f.name]))
        if f.name in total
        else pa.array(out[f.name])
        for f in sch
    }
    return pa.table(cols, schema=sch)


def finish(work: "str | Path") -> tuple[list[pa.Table], dict]:
    """eval.parquet and the maps into the set's folder; the rejects tables, in order; figures."""
    work = Path(work)
    ctx, idm, pm = _ctx(work), _meta(work / "ids"), _meta(work / "plan")
    buckets, set_dir = idm["buckets"], work.parent
    _write_eval(
        set_dir / schema.EVAL_FILE,
        schema.eval_schema(ctx["has_time"]),
        [work / "route" / str(b) / "eval.arrow" for b in range(buckets)],
        pm["users"],
    )
    um = _RowGroups(set_dir / schema.USER_MAP, schema.MAP_SCHEMA)
    for b in range(buckets):
        u = _read_ipc(work / "bucket" / str(b) / "users.arrow").column("id").combine_chunks()
        ids_ = np.arange(pm["users"][b] + 1, pm["users"][b] + len(u) + 1, dtype=np.int64)
        um.add(pa.table({"id": ids_, "raw_id": u.cast(pa.string())}, schema=schema.MAP_SCHEMA))
    um.close()
    items = _ids(work, "items").filter(pa.array(np.load(work / "plan" / "present.npy")))
    pq.write_table(
        pa.table(
            {"id": np.arange(1, len(items) + 1, dtype=np.int64), "raw_id": items.cast(pa.string())},
            schema=schema.MAP_SCHEMA,
        ),
        set_dir / schema.ITEM_MAP,
    )
    return _rejects(work, len(ctx["paths"]), buckets), _figures(work, idm, pm, buckets)


def _rejects(work: Path, files: int, buckets: int) -> list[pa.Table]:
    out = _read_rejects(work, files)
    for reason in ("duplicate_event", "too_short", "history_too_long"):
        parts = [work / "bucket" / str(b) / f"rejects-{reason}.arrow" for b in range(buckets)]
        tables = [_read_ipc(p) for p in parts if p.exists()]
        if tables:
            t = pa.concat_tables(tables)
            if reason == "duplicate_event":
                t = t.sort_by("ev").drop_columns(["ev"])
            out.append(t.combine_chunks())
    tails = [work / "route" / str(b) / "tail.arrow" for b in range(buckets)]
    tables = [_read_ipc(p) for p in tails if p.exists()]
    if tables:
        out.append(pa.concat_tables(tables).combine_chunks())
    return out


def _figures(work: Path, idm: dict, pm: dict, buckets: int) -> dict:
    """The manifest's figures (see build._figures), summed over the buckets."""
    work_b = [_meta(work / "bucket" / str(b)) for b in range(buckets)]
    tot = lambda k: sum(m[k] for m in work_b)  # noqa: E731
    num_users, n = tot("num_users"), pm["samples"][-1]
    c = idm["counts"]
    return {
        "num_users": num_users,
        "num_items": pm["num_items"],
        "num_samples": n,
        "steps": pm["steps"],
        "counts": {
            "lines": c["lines"],
            "blank_lines": c["blank_lines"],
            "events_read": c["events_read"],
            "events_used": tot("events_used"),
            "duplicates": tot("duplicates"),
            "rows_rejected": c["rows_rejected"],
            "users_read": tot("users_read"),
            "users_rejected": tot("users_rejected"),
            "eval_users": num_users,
            "users_without_sample": num_users - n,
            "samples_written": n - pm["dropped"],
            "samples_dropped_tail": pm["dropped"],
            "samples_filled_tail": pm["filled"],
            "samples_truncated": tot("truncated"),
            "items_truncated": tot("items_truncated"),
            "tokens": pm["tokens"],
        },
        "stats": pm["stats"],
        "bubble_fraction_random": pm["bubble_fraction_random"],
        "total_cost": pm["total_cost"],
        "time_unit": pm["unit"],
    }


# ---------------------------------------------------------------- driver


def batch_rows(budget: int) -> int:
    """Rows per batch read from Parquet under `budget` (a batch costs ~1 KB a row while typed)."""
    return int(min(max(budget // 1024, MIN_BATCH_ROWS), 1 << 22))


class Pool:
    """Runs a stage over its indices: here, or in `workers` processes (spawned: pyarrow's threads
    do not survive a fork). Stage functions take (work, index) and return a small dict."""

    def __init__(self, workers: int):
        self.ex = ProcessPoolExecutor(workers, mp_context=get_context("spawn")) if workers > 1 else None

    def map(self, fn: Callable[[str, int], dict], work: Path, n: int, done: Callable[[dict], None]) -> list[dict]:
        if self.ex is None:
            out = []
            for i in range(n):
                out.append(fn(str(work), i))
                done(out[-1])
            return out
        futs = [self.ex.submit(fn, str(work), i) for i in range(n)]
        for fu in futs:
            done(fu.result())
        return [fu.result() for fu in futs]

    def close(self) -> None:
        if self.ex is not None:
            self.ex.shutdown(cancel_futures=True)


def run(
    tmp: Path,
    ctx: dict,
    *,
    budget: int,
    buckets: int | None,
    workers: int,
    say: Callable[[str], None],
    timings: dict[str, float],
) -> tuple[list[pa.Table], dict, float]:
    """Every stage in order over a work folder inside the staging folder `tmp`; returns the
    rejects tables, the figures (build.seal writes the rest) and when writing began. The work
    folder is removed."""
    work = tmp / "_work"
    work.mkdir()
    ctx = {**ctx, "batch_rows": batch_rows(budget), "budget": budget}
    _json(work / "ctx.json", ctx)
    pool = Pool(workers)
    try:
        t = time.monotonic()
        nf = len(ctx["paths"])
        pool.map(scan, work, nf, lambda m: say(f"dataprep: scanned {m['file']}: {m['events']} events"))
        idm = ids(work, budget, buckets)
        nb = idm["buckets"]
        timings["read_s"] = time.monotonic() - t
        say(
            f"dataprep: read {idm['counts']['lines']} lines, {idm['counts']['events_read']} events, "
            f"{idm['counts']['rows_rejected']} rejected; {idm['users']} users in {nb} buckets "
            f"(--memory-budget {budget >> 20}MB) ({timings['read_s']:.1f} s)"
        )
        t = time.monotonic()
        pool.map(split, work, nf, lambda m: None)
        pool.map(
            bucket,
            work,
            nb,
            lambda m: say(
                f"dataprep: bucket {m['bucket'] + 1}/{nb}: {m['events']} events, {m['num_users']} users, "
                f"{m['samples']} samples ({m['seconds']:.1f} s)"
            ),
        )
        timings["sequences_s"] = time.monotonic() - t
        plan(work, nb, say, timings)
        t_write = time.monotonic()
        pool.map(route, work, nb, lambda m: None)
        pool.map(write, work, ctx["config"]["world_size"], lambda m: None)
        out = finish(work)
    finally:
        pool.close()
    shutil.rmtree(work)
    return (*out, t_write)
