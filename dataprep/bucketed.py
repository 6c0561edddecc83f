"""The bucketed build: the in-memory build's shard set, byte for byte, in memory bounded by a bucket.

Stages over a work folder (dataprep.workdir), each a function of (work, index), so it runs here,
in a process pool (`--workers`) or as an Airflow task: scan(f), ids(), split(f), bucket(b),
plan(), route(b), then write(r) and finish() (dataprep.assemble). Buckets are ranges of the
sorted user ids cut at about equal event counts. Stage by stage: docs/dataprep.md.
"""

import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import TypeVar, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dataprep import heap, process, readers, schema, sequences, temporal, workdir
from dataprep.assemble import finish, write, write_eval, write_maps
from dataprep.cost import load_cost_model
from dataprep.counts import Counts, sum_counts
from dataprep.errors import DataprepError
from dataprep.readers.events import Restart

BYTES_PER_EVENT = 400  # peak working set of a bucket per event (build_sequences + samples), measured
IN_MEMORY_BYTES_PER_EVENT = 130  # the in-memory build's peak per event (10M Parquet events: 1.15 GB)
PIECE_ROWS = 16_384  # rows per record batch of a rank piece at most (write(r) holds one per bucket)
MIN_BATCH_ROWS = 1 << 16  # rows per batch read from Parquet, at least
THREADS = 2  # stages at once in a one-process build (--workers 1), each with its share of the budget
T = TypeVar("T")
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


def scan(work: "str | Path", s: int) -> dict:
    """Read span s of the inputs (ctx "spans", readers.spans: a file, or a run of a Parquet
    file's row groups): events (raw ids; times, or input positions), ids, counts, rejects."""
    again: dict = {}
    while True:
        try:
            return _scan(Path(work), s, again)
        except Restart as e:  # a CSV file read again from its start (see readers.events.Restart)
            again = {"kinds": e.kinds, "replace": e.replace}


def _scan(work: Path, s: int, again: dict) -> dict:
    ctx = workdir.ctx(work)
    span = ctx["spans"][s]
    path = ctx["paths"][span["file"]]
    counts: dict[str, int] = {}
    groups: dict[int, list[pa.Table]] = {}
    users, items = Counts(), Counts()
    types: dict[str, set[str]] = {"user": set(), "item": set()}
    n, changed = 0, False
    with workdir.task_dir(work / "scan" / str(s)) as d:
        evs = workdir.Events(d)
        part = span if "groups" in span else None
        for cols, rejects, c in readers.iter_file(
            path, ctx["fmt"], ctx["batch_rows"], **ctx["reader_options"], **again, span=part
        ):
            for k, v in c.items():
                counts[k] = counts.get(k, 0) + v
            for tag, t in rejects:
                groups.setdefault(tag, []).append(t)
            ev = pa.table({k: _arrow(cols[k]) for k in ("user", "item", "ts")})
            for k in types:
                types[k].add(str(ev.schema.field(k).type))
            if ev.num_rows == 0:
                continue
            if not evs.add(ev, cols["line"]):  # a CSV file is read again when its parts end (Restart)
                changed = True
                continue
            n += ev.num_rows
            users.add(ev.column("user").combine_chunks())
            items.add(ev.column("item").combine_chunks())
        evs.lines.close()
        if changed:
            raise DataprepError(f"{path}: id columns change type inside the file; store one type per column")
        if n:
            workdir.write_ipc(d / "users.arrow", users.table())
            workdir.write_ipc(d / "items.arrow", pa.table({"i": items.table().column("u")}))
        rej = [pa.concat_tables(groups[k]).combine_chunks() for k in sorted(groups)]
        if rej:
            with pa.OSFile(str(d / "rejects.arrow"), "wb") as fo, pa.ipc.new_file(fo, rej[0].schema) as w:
                for t in rej:
                    w.write_table(t)
        workdir.write_json(
            d / "meta.json",
            {
                "counts": counts,
                "events": n,
                "rejected": sum(t.num_rows for t in rej),
                "checks": sorted(groups),  # each table's check number in rejects.arrow (scan_rejects)
                "types": _typenames(types),
                "line0": evs.lines.first,
            },
        )
    part = f" rows {span['rows'] + 1}-{span['rows'] + counts.get('lines', 0)}" if "rows" in span else ""
    return {"file": path + part, "events": n}


def _arrow(a: "pa.Array | np.ndarray") -> pa.Array:
    return a if isinstance(a, pa.Array) else pa.array(np.ascontiguousarray(a, dtype=np.int64))


def _typenames(types: dict[str, set[str]]) -> dict[str, str]:
    return {k: (v.pop() if len(v) == 1 else "string") for k, v in types.items()}


def ids(work: "str | Path", budget: int, buckets: int | None) -> dict:
    """Merge the spans' ids: users and items sorted (dense-id order), B buckets of users."""
    work = Path(work)
    ctx = workdir.ctx(work)
    paths, spans = ctx["paths"], len(ctx["spans"])
    metas = [workdir.meta(work / "scan" / str(s)) for s in range(spans)]
    lines = sum(m["counts"].get("lines", 0) for m in metas)
    if sum(m["rejected"] for m in metas) > ctx["max_reject_fraction"] * max(lines, 1):
        from dataprep.rejects import check_rejects

        check_rejects(workdir.scan_rejects(work), lines, ctx["max_reject_fraction"])
    events = sum(m["events"] for m in metas)
    if events == 0:
        raise DataprepError(
            f"{', '.join(paths)}: no valid interactions left after rejecting bad rows; "
            "check --format and the rejects listed above"
        )
    typ = {k: pa.string() if any(m["types"][k] == "string" for m in metas) else pa.int64() for k in ("user", "item")}
    have = [work / "scan" / str(s) for s in range(spans) if metas[s]["events"]]
    uparts = [workdir.read_ipc(d / "users.arrow") for d in have]
    users = sum_counts([pa.table({"u": t.column("u").cast(typ["user"]), "n": t.column("n")}) for t in uparts])
    items = pc.unique(
        pa.concat_arrays(
            [workdir.read_ipc(d / "items.arrow").column("i").cast(typ["item"]).combine_chunks() for d in have]
        )
    )
    items = pc.take(items, pc.sort_indices(items))
    cum = np.cumsum(users.column("n").to_numpy())
    b = buckets or max(1, math.ceil(events * BYTES_PER_EVENT / budget))
    b = min(b, users.num_rows)
    starts = np.unique(np.searchsorted(cum, events * np.arange(b) / b, side="right")).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum([m["events"] for m in metas])]).tolist()
    with workdir.task_dir(work / "ids") as d:
        workdir.write_ipc(d / "users.arrow", pa.table({"id": users.column("u").combine_chunks()}))
        workdir.write_ipc(d / "items.arrow", pa.table({"id": items}))
        np.save(d / "starts.npy", starts)
        counts = {k: sum(m["counts"].get(k, 0) for m in metas) for k in ("lines", "blank_lines")}
        meta = {
            "buckets": len(starts),
            "offsets": offsets,
            "users": users.num_rows,
            "items": len(items),
            "counts": {**counts, "events_read": events, "rows_rejected": sum(m["rejected"] for m in metas)},
        }
        workdir.write_json(d / "meta.json", meta)
    return meta


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


def split(work: "str | Path", f: int) -> dict:
    """Span f's events -> one piece per bucket: global event index, user and item codes, time."""
    work = Path(work)
    ctx, idm = workdir.ctx(work), workdir.meta(work / "ids")
    starts = np.load(work / "ids" / "starts.npy")
    user_code, item_code = _lookup(workdir.read_ids(work, "users")), _lookup(workdir.read_ids(work, "items"))
    # codes as int32 where every id fits: a third fewer bytes through the work folder
    code = np.int32 if max(idm["users"], idm["items"]) < 1 << 31 else np.int64
    evt = np.int32 if idm["offsets"][-1] < 1 << 31 else np.int64  # event indices likewise
    # 16-bit bucket numbers sort stably by radix (an int64 stable sort is a merge sort)
    bnum = np.int16 if len(starts) < 1 << 15 else np.int32
    pos = [idm["offsets"][f]]
    # each user code's bucket, looked up (a table of one entry a user) rather than searched for
    bucket_of = np.repeat(np.arange(len(starts), dtype=bnum), np.diff(np.append(starts, idm["users"])))

    def cut(part: Path) -> tuple[pa.Table, np.ndarray]:
        """A part's events by bucket, stably, and where each bucket's rows begin."""
        with pa.memory_map(str(part)) as fi:
            batch = pa.ipc.open_stream(fi).read_all()
        n, off = batch.num_rows, pos[0]
        pos[0] += n
        u = user_code(batch.column("user"))
        ts = batch.column("ts").to_numpy()
        b = bucket_of[u]
        order = np.argsort(b, kind="stable")
        t = pa.table(
            {
                "ev": (order + off).astype(evt, copy=False),
                "u": u[order].astype(code, copy=False),
                "i": item_code(batch.column("item")).astype(code, copy=False)[order],
                "ts": ts[order] if ctx["has_time"] else ts[order] + idm["offsets"][f],
            }
        )
        if ctx.get("drop_inputs"):  # a one-process build (run): no task is run again
            part.unlink()
        return t, np.searchsorted(b[order], np.arange(len(starts) + 1))

    with workdir.task_dir(work / "split" / str(f)) as d:
        writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}
        # the next part is cut in a thread while this one is written
        for t, cuts in ahead(map(cut, workdir.event_parts(work, f))):
            for k in np.flatnonzero(np.diff(cuts)).tolist():
                if k not in writers:
                    writers[k] = pa.ipc.new_file(str(d / f"b{k}.arrow"), t.schema)
                writers[k].write_table(t.slice(cuts[k], cuts[k + 1] - cuts[k]))
        for w in writers.values():
            w.close()
    return {"file": f, "events": pos[0] - idm["offsets"][f]}


_END = object()


def ahead(items: Iterator[T]) -> Iterator[T]:
    """`items`, the next one made in a thread of its own while the caller works on this one
    (an iterator's exceptions reach the caller as they are)."""
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(next, items, _END)
        while (x := fut.result()) is not _END:
            fut = ex.submit(next, items, _END)
            yield cast(T, x)


def bucket(work: "str | Path", b: int) -> dict:
    """Bucket b's sequences, as build_sequences makes them, items as global codes, raw times."""
    work = Path(work)
    t0 = time.monotonic()
    ctx, idm = workdir.ctx(work), workdir.meta(work / "ids")
    starts = np.load(work / "ids" / "starts.npy")
    lo = int(starts[b])
    parts, src, line = [], [], []
    for f, span in enumerate(ctx["spans"]):
        p = work / "split" / str(f) / f"b{b}.arrow"
        if p.exists():
            parts.append(workdir.read_ipc(p))
            src.append(np.full(parts[-1].num_rows, span["file"], np.int32))
            ev_f = parts[-1].column("ev").to_numpy() - idm["offsets"][f]
            line.append(workdir.event_lines(work, f, ev_f))
    t = pa.concat_tables(parts)
    col = {k: t.column(k).to_numpy() for k in t.column_names}
    del t, parts
    hi = int(starts[b + 1]) if b + 1 < len(starts) else idm["users"]
    users = workdir.read_ids(work, "users").slice(lo, hi - lo)
    u_code = col["u"].astype(np.int64) - lo  # every user of the range has events here
    ev = readers.Interactions(
        user=users.take(pa.array(u_code)),
        item=pa.array(col["i"]),
        ts=col["ts"],
        source=np.concatenate(src),
        line=np.concatenate(line),
        paths=ctx["paths"],
        has_time=ctx["has_time"],
    )
    # items as global codes: their own ids table is 0..items-1
    codes = (u_code, users, col["i"].astype(np.int64), pa.array(np.arange(idm["items"], dtype=col["i"].dtype)))
    ev_index = col.pop("ev")
    del col
    c = ctx["config"]
    seq = sequences.build_sequences(
        ev, dedup=c["dedup"], max_events=c["max_events"], raw_times=True, part=True, codes=codes
    )
    return _save_bucket(work, b, seq, ev_index, len(ev), time.monotonic() - t0)


def _save_bucket(work: Path, b: int, seq: sequences.Sequences, ev_index: np.ndarray, n: int, took: float) -> dict:
    length, truncated, items_truncated = sequences.sample_lengths(
        sequences.leave_one_out(seq).train_len, workdir.ctx(work)["config"]["max_len"]
    )
    with workdir.task_dir(work / "bucket" / str(b)) as d:
        arrays = {"offsets": seq.offsets, "values": seq.values, "items": seq.item_raw.to_numpy()}
        arrays["length"] = length.astype(np.int32)
        if seq.timestamps is not None:
            arrays["ts"] = seq.timestamps
        for k, a in arrays.items():  # one .npy each: read back memory-mapped (workdir.seq)
            np.save(d / f"{k}.npy", a)
        workdir.write_ipc(d / "users.arrow", pa.table({"id": seq.user_raw}))
        short = 0
        for r in seq.rejects:
            reason = r.column("reason")[0].as_py()
            if reason == "duplicate_event":
                assert seq.duplicate_events is not None
                r = r.append_column("ev", pa.array(ev_index[seq.duplicate_events]))
            short += r.num_rows if reason == "too_short" else 0
            workdir.write_ipc(d / f"rejects-{reason}.arrow", r)
        ts = seq.timestamps
        meta = {
            **seq.counts,
            "num_users": seq.num_users,
            "samples": len(length),
            "too_short": short,
            "max_abs_ts": int(np.abs(ts).max()) if ts is not None and len(ts) else 0,
            "truncated": truncated,
            "items_truncated": items_truncated,
            "events": n,
            "seconds": round(took, 3),
        }
        workdir.write_json(d / "meta.json", meta)
    return {"bucket": b, **meta}


def _samples_of(z: dict[str, np.ndarray], meta: dict, win: tuple[int, int] | None, unit: str, max_len: int):
    """A bucket's sample lengths and figures (eval users, truncation, the split's counts): the
    bucket stage's for leave-one-out, else those of its users' holdout at the window `win`."""
    if win is None:
        return np.array(z["length"]), {"eval_users": meta["num_users"]} | {
            k: meta[k] for k in ("truncated", "items_truncated")
        }
    hold = temporal.holdout_at(np.asarray(z["offsets"]), sequences.in_seconds(np.asarray(z["ts"]), unit), *win)
    length, truncated, items_truncated = sequences.sample_lengths(hold.train_len, max_len)
    figures = {"eval_users": len(hold.users), "truncated": truncated, "items_truncated": items_truncated}
    return length.astype(np.int32), figures | hold.info


def plan(work: "str | Path", buckets: int, say: Callable[[str], None], timings: dict[str, float]) -> dict:
    """The item map, the time unit, the split and the balance plan over every bucket's samples."""
    from dataprep.build import _balance

    work = Path(work)
    ctx = workdir.ctx(work)
    metas = [workdir.meta(work / "bucket" / str(b)) for b in range(buckets)]
    paths = ctx["paths"]
    if sum(m["events_used"] for m in metas) == 0:
        raise DataprepError(
            f"{', '.join(paths)}: no user has the {sequences.MIN_EVENTS} events leave-one-out needs "
            f"({sum(m['too_short'] for m in metas)} users too short); give more data"
        )
    unit = sequences.time_unit(max(m["max_abs_ts"] for m in metas)) if ctx["has_time"] else ""
    present, lengths, figs, split_ = _samples(work, ctx, metas, unit)
    length = np.concatenate(lengths)
    if len(length) == 0:
        raise DataprepError(
            f"{', '.join(paths)}: no user has the 4 events a training sample needs "
            "(history, target, validation, test); give more data"
        )
    cost = load_cost_model(ctx["config"]["cost_model"])(length)
    p, st, st_random = _balance(cost, ctx["config"], quiet=True, say=say, timings=timings)
    offsets = lambda xs: np.concatenate([[0], np.cumsum(xs)]).astype(np.int64).tolist()  # noqa: E731
    with workdir.task_dir(work / "plan") as d:
        np.save(d / "dense_items.npy", np.cumsum(present))
        np.save(d / "step.npy", p.step)
        np.save(d / "rank.npy", p.rank)
        np.save(d / "present.npy", present)
        meta = {
            "users": offsets([m["num_users"] for m in metas]),
            "samples": offsets([len(x) for x in lengths]),
            "eval_users": offsets([f["eval_users"] for f in figs]),  # each bucket's rows of eval.parquet
            "unit": unit,
            "steps": p.steps,
            "dropped": p.dropped,
            "filled": p.filled,
            "stats": st,
            "bubble_fraction_random": st_random["bubble_fraction"],
            "total_cost": float(cost[p.step >= 0].sum()),
            "tokens": int(length.sum()),
            "num_items": int(present.sum()),
            "truncated": sum(f["truncated"] for f in figs),
            "items_truncated": sum(f["items_truncated"] for f in figs),
            "split": split_,  # the manifest's (temporal.split_info); empty: leave-one-out
        }
        workdir.write_json(d / "meta.json", meta)
    return meta


def _samples(work: Path, ctx: dict, metas: list[dict], unit: str) -> tuple[np.ndarray, list, list[dict], dict]:
    """Which items the kept events hold, each bucket's sample lengths and figures (_samples_of),
    and the split's figures (temporal.split_info; empty for leave-one-out). A temporal split's
    cut and window end are the in-memory build's: temporal.window over every bucket's times."""
    c, win = ctx["config"], None
    if c.get("split") == "temporal":

        def times() -> Iterator[np.ndarray]:  # every bucket's kept events' times, a bucket at a time
            return (sequences.in_seconds(np.asarray(workdir.seq(work, b)["ts"]), unit) for b in range(len(metas)))

        win = temporal.window(times, c.get("cut"), c.get("horizon"))
    present = np.zeros(len(workdir.read_ids(work, "items")), bool)
    lengths, figs = [], []
    for b, m in enumerate(metas):
        z = workdir.seq(work, b)
        present[z["items"]] = True
        length, fig = _samples_of(z, m, win, unit, c["max_len"])
        lengths.append(length)
        figs.append(fig)
    return present, lengths, figs, temporal.split_info(*win, c.get("cut"), figs) if win else {}


def route(work: "str | Path", b: int) -> dict:
    """Bucket b's eval rows, tail rejects, and its samples as one piece per rank, by step."""
    work = Path(work)
    ctx, pm = workdir.ctx(work), workdir.meta(work / "plan")
    c = ctx["config"]
    dense = np.load(work / "plan" / "dense_items.npy", mmap_mode="r")
    arrays = workdir.seq(work, b)
    users = workdir.read_ipc(work / "bucket" / str(b) / "users.arrow").column("id").combine_chunks()
    ts = arrays.get("ts")
    seq = sequences.Sequences(
        offsets=arrays["offsets"],
        values=dense[arrays["items"][arrays["values"] - 1]].astype(np.int32),
        user_raw=users,
        item_raw=pa.array([], pa.int64()),
        timestamps=sequences.in_seconds(ts, pm["unit"]) if ts is not None else None,
    )
    uo, so = pm["users"][b], pm["samples"][b]
    w, secs = pm["split"], seq.timestamps  # a temporal split's window (plan's), else leave-one-out
    hold = temporal.holdout_at(seq.offsets, secs, w["cut"], w["cut"] + w["horizon"]) if w and secs is not None else None
    with workdir.task_dir(work / "route" / str(b)) as d:
        et = sequences.eval_table(seq, hold)
        uid = et.column(0).combine_chunks().to_numpy() + uo  # global dense user ids
        workdir.write_ipc(d / "eval.arrow", et.set_column(0, et.schema.field(0), pa.array(uid)))
        samples = sequences.train_samples(seq, c["max_len"], hold)
        n = len(samples.user_id)
        step = np.load(work / "plan" / "step.npy", mmap_mode="r")[so : so + n]
        rank = np.load(work / "plan" / "rank.npy", mmap_mode="r")[so : so + n]
        dropped = np.flatnonzero(step < 0)
        if len(dropped):
            from dataprep.rejects import tail_rejects

            workdir.write_ipc(
                d / "tail.arrow", tail_rejects(users.take(pa.array(samples.user_id[dropped] - 1)), so + dropped)
            )
        cost = load_cost_model(c["cost_model"])(samples.length)
        # write(r) holds one batch of each bucket's piece: a quarter of the budget for all of them
        row_bytes = 64 + (12 if ts is not None else 4) * c["max_len"]
        rows = int(min(PIECE_ROWS, max(64, ctx["budget"] // 4 // (len(pm["users"]) - 1) // row_bytes)))
        for r in range(c["world_size"]):
            idx = np.flatnonzero((rank == r) & (step >= 0))
            idx = idx[np.argsort(step[idx], kind="stable")]
            workdir.write_ipc(d / f"r{r}.arrow", _shard_rows(samples, idx, so, uo, step, rank, cost), rows)
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


def batch_rows(budget: int) -> int:
    """Rows per batch read from Parquet under `budget` (a batch costs ~1 KB a row while typed)."""
    return int(min(max(budget // 1024, MIN_BATCH_ROWS), 1 << 22))


class Pool:
    """Runs a stage over its indices: in `workers` processes (spawned: pyarrow's threads do not
    survive a fork), or with one worker in THREADS threads of this process (the stages are mostly
    numpy and pyarrow, which release the GIL). Stage functions take (work, index) and return a
    small dict. A task's inputs that no other task reads are removed when it is done; freed
    memory is kept for reuse in every process until close (dataprep.heap); worker processes
    import no pandas (dataprep.process)."""

    def __init__(self, workers: int):
        heap.keep()
        self.ex: Executor = (
            ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=process.worker)
            if workers > 1
            else ThreadPoolExecutor(THREADS)
        )

    def map(self, fn: Callable[[str, int], dict], work: Path, n: int, done: Callable[[dict], None]) -> list[dict]:
        return self.tasks([(fn, i) for i in range(n)], work, done)

    def tasks(
        self, calls: list[tuple[Callable[[str, int], dict], int]], work: Path, done: Callable[[dict], None]
    ) -> list[dict]:
        """Each (stage, index) of `calls`, started in that order; `done` sees each result in order."""
        futs = [self.ex.submit(fn, str(work), i) for fn, i in calls]
        for (fn, i), fu in zip(calls, futs, strict=True):
            done(fu.result())
            workdir.spent(work, fn.__name__, i)  # this build re-runs no task: drop what only it read
        return [fu.result() for fu in futs]

    def close(self) -> None:
        self.ex.shutdown(cancel_futures=True)
        heap.release()


def run(
    tmp: Path,
    ctx: dict,
    *,
    budget: int,
    buckets: int | None,
    workers: int,
    say: Callable[[str], None],
    timings: dict[str, float],
) -> tuple[list[pa.Table], dict, float, dict[str, str]]:
    """Every stage in order over a work folder inside the staging folder `tmp`; returns the
    rejects tables, the figures (build.seal writes the rest), when writing began and the
    checksums of the files written (shards, eval). The work folder is removed."""
    work = tmp / "_work"
    work.mkdir()
    lane = budget // (THREADS if workers == 1 else 1)  # a process's threads share its budget
    ctx = {**ctx, "batch_rows": batch_rows(lane), "budget": lane, "drop_inputs": True}
    workdir.write_json(work / "ctx.json", ctx)
    pool = Pool(workers)
    try:
        t = time.monotonic()
        nf = len(ctx["spans"])
        pool.map(scan, work, nf, lambda m: say(f"dataprep: scanned {m['file']}: {m['events']} events"))
        idm = ids(work, lane, buckets)
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
        # eval.parquet (the longest task) beside the rank files and the maps, then the rejects
        ranks = [(write, r) for r in range(ctx["config"]["world_size"])]
        written = pool.tasks([(write_eval, 0), *ranks, (write_maps, 0)], work, lambda m: None)
        sums = {k: v for m in written for k, v in m["sha256"].items()}
        out = finish(work, written=True)
    finally:
        pool.close()
    shutil.rmtree(work)
    return (*out, t_write, sums)
