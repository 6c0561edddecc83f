"""The bucketed build's last stages: each rank's shard file from the buckets' pieces, step by step
(write), then eval, maps and rejects in the in-memory build's order and row groups (finish)."""

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dataprep import schema, workdir
from dataprep.files import sha256_file, staged

ROW_GROUP_ROWS = 1 << 20  # pq.write_table's row groups: eval and maps are written in the same ones


class _Piece:
    """One bucket's piece of a rank (rows in step order, in record batches), where each step's
    rows begin, and its rows read a block at a time: memory-mapped, a billion events' pieces
    peaked at 4.2 GB RSS, even with their pages released after each block (the kernel maps
    pages around each one read, and a block reads a few rows of each of 1,488 pieces)."""

    def __init__(self, path: Path, steps: int):
        with pa.OSFile(str(path)) as f:  # the step column alone, batch by batch
            col = pa.ipc.open_file(f, options=_STEP_ONLY).read_all().column("step")
        self.starts = np.cumsum([0, *(len(c) for c in col.chunks)])
        self.cuts = np.searchsorted(col.to_numpy(), np.arange(steps + 1)).astype(np.int32)
        self.file = pa.OSFile(str(path))
        self.reader = pa.ipc.open_file(self.file)

    def rows(self, lo: int, hi: int) -> pa.Table:
        """Rows lo..hi-1, read from the batches that hold them."""
        k0, k1 = int(np.searchsorted(self.starts, lo, "right")) - 1, int(np.searchsorted(self.starts, hi, "left"))
        t = pa.Table.from_batches([self.reader.get_batch(k) for k in range(k0, k1)])
        return t.slice(lo - int(self.starts[k0]), hi - lo)


# "step" sits at the same place with and without timestamps (they come last)
_STEP_ONLY = pa.ipc.IpcReadOptions(included_fields=[schema.SHARD_SCHEMA.get_field_index("step")])


def write(work: "str | Path", r: int) -> dict:
    """Rank r's shard file: row group s = step s's rows of every bucket, in sample-id order."""
    work = Path(work)
    ctx, pm = workdir.ctx(work), workdir.meta(work / "plan")
    buckets = workdir.meta(work / "ids")["buckets"]
    out = work.parent / schema.shard_file(r)
    workdir.open_files(buckets)
    pieces = [_Piece(work / "route" / str(b) / f"r{r}.arrow", pm["steps"]) for b in range(buckets)]
    step_rows = np.zeros(pm["steps"], np.int64)
    for p in pieces:
        step_rows += np.diff(p.cuts)
    bounds = _blocks(step_rows, block_rows(ctx))
    try:
        sch = schema.shard_schema(ctx["has_time"])
        with staged(out) as tmp, pq.ParquetWriter(tmp, sch, **schema.write_options(sch)) as w:
            for a, b in zip(bounds, bounds[1:], strict=False):
                for t in _steps(pieces, a, b):
                    w.write_table(t)  # one call = one row group = one step
    finally:
        for p in pieces:
            p.file.close()
    # its checksum here, in parallel with the other tasks, not in build.seal after them all
    return {"rank": r, "sha256": {schema.shard_file(r): sha256_file(out)}}


def block_rows(ctx: dict) -> int:
    """Rows write(r) copies at once: an eighth of the budget, each row at its longest."""
    return max(1, ctx["budget"] // 8 // (64 + (12 if ctx["has_time"] else 4) * ctx["config"]["max_len"]))


def _blocks(step_rows: np.ndarray, rows: int) -> list[int]:
    """Where blocks of steps begin (and the last ends): about `rows` rows a block, one step at least."""
    bounds, n = [0], 0
    for s, k in enumerate(step_rows.tolist()):
        n += k
        if n >= rows:
            bounds.append(s + 1)
            n = 0
    return bounds if bounds[-1] == len(step_rows) else [*bounds, len(step_rows)]


def _steps(pieces: list[_Piece], a: int, b: int) -> Iterator[pa.Table]:
    """Steps a..b-1 of a rank, each its buckets' rows in bucket order: one copy of the block
    and a stable sort by step, not a slice of every piece for every step."""
    parts = [p.rows(int(p.cuts[a]), int(p.cuts[b])) for p in pieces if p.cuts[b] > p.cuts[a]]
    t = pa.concat_tables(parts).combine_chunks()
    order = np.argsort(t.column("step").to_numpy(), kind="stable")
    t = t.take(pa.array(order))
    at = np.searchsorted(t.column("step").to_numpy(), np.arange(a, b + 1)).tolist()
    for s in range(b - a):
        yield t.slice(at[s], at[s + 1] - at[s])


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


def _write_eval(path: Path, sch: pa.Schema, pieces: list[Path], row_off: list[int]) -> None:
    """eval.parquet from the buckets' pieces, in pq.write_table's row groups, each built by
    copying its rows into arrays allocated once (a row group and one piece in memory, not two)."""
    group: list[tuple[Path, int, int]] = []  # (piece, first row, rows)
    n = 0
    with pq.ParquetWriter(path, sch, **schema.write_options(sch)) as w:
        for b, piece in enumerate(pieces):
            rows, a = row_off[b + 1] - row_off[b], 0
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
        out[f.name] = np.empty(total.get(f.name, n), pa.array([], typ).to_numpy().dtype)
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


def write_eval(work: "str | Path", _: int = 0) -> dict:
    """eval.parquet into the set's folder (finish's first part: a one-process build runs it as a
    task beside the rank files)."""
    work = Path(work)
    ctx, pm = workdir.ctx(work), workdir.meta(work / "plan")
    _write_eval(
        work.parent / schema.EVAL_FILE,
        schema.eval_schema(ctx["has_time"]),
        [work / "route" / str(b) / "eval.arrow" for b in range(len(pm["users"]) - 1)],
        pm["eval_users"],
    )
    return {"eval": True, "sha256": {schema.EVAL_FILE: sha256_file(work.parent / schema.EVAL_FILE)}}


def finish(work: "str | Path", written: bool = False) -> tuple[list[pa.Table], dict]:
    """eval.parquet and the maps into the set's folder (unless `written`: a one-process build
    runs write_eval and write_maps as tasks beside the rank files); the rejects tables, in
    order; figures. (write and write_eval return their files' checksums, which build.seal
    takes instead of reading the files again.)"""
    work = Path(work)
    idm, pm = workdir.meta(work / "ids"), workdir.meta(work / "plan")
    if not written:
        write_eval(work)
        write_maps(work)
    return _rejects(work, idm["buckets"]), _figures(work, idm, pm, idm["buckets"])


def write_maps(work: "str | Path", _: int = 0) -> dict:
    """The user and item maps into the set's folder."""
    work = Path(work)
    idm, pm = workdir.meta(work / "ids"), workdir.meta(work / "plan")
    buckets, set_dir = idm["buckets"], work.parent
    um = _RowGroups(set_dir / schema.USER_MAP, schema.MAP_SCHEMA)
    for b in range(buckets):
        u = workdir.read_ipc(work / "bucket" / str(b) / "users.arrow").column("id").combine_chunks()
        ids_ = np.arange(pm["users"][b] + 1, pm["users"][b] + len(u) + 1, dtype=np.int64)
        um.add(pa.table({"id": ids_, "raw_id": u.cast(pa.string())}, schema=schema.MAP_SCHEMA))
    um.close()
    items = workdir.read_ids(work, "items").filter(pa.array(np.load(work / "plan" / "present.npy")))
    pq.write_table(
        pa.table(
            {"id": np.arange(1, len(items) + 1, dtype=np.int64), "raw_id": items.cast(pa.string())},
            schema=schema.MAP_SCHEMA,
        ),
        set_dir / schema.ITEM_MAP,
    )
    return {"maps": True, "sha256": {}}


def _rejects(work: Path, buckets: int) -> list[pa.Table]:
    out = workdir.scan_rejects(work)
    for reason in ("duplicate_event", "too_short", "history_too_long"):
        parts = [work / "bucket" / str(b) / f"rejects-{reason}.arrow" for b in range(buckets)]
        tables = [workdir.read_ipc(p) for p in parts if p.exists()]
        if tables:
            t = pa.concat_tables(tables)
            if reason == "duplicate_event":
                t = t.sort_by("ev").drop_columns(["ev"])
            out.append(t.combine_chunks())
    tails = [work / "route" / str(b) / "tail.arrow" for b in range(buckets)]
    tables = [workdir.read_ipc(p) for p in tails if p.exists()]
    if tables:
        out.append(pa.concat_tables(tables).combine_chunks())
    return out


def _figures(work: Path, idm: dict, pm: dict, buckets: int) -> dict:
    """The manifest's figures (see build._figures), summed over the buckets."""
    work_b = [workdir.meta(work / "bucket" / str(b)) for b in range(buckets)]
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
            "eval_users": pm["eval_users"][-1],
            "users_without_sample": num_users - n,
            "samples_written": n - pm["dropped"],
            "samples_dropped_tail": pm["dropped"],
            "samples_filled_tail": pm["filled"],
            "samples_truncated": pm["truncated"],
            "items_truncated": pm["items_truncated"],
            "tokens": pm["tokens"],
        },
        "stats": pm["stats"],
        "bubble_fraction_random": pm["bubble_fraction_random"],
        "total_cost": pm["total_cost"],
        "time_unit": pm["unit"],
        "split": pm["split"],
    }
