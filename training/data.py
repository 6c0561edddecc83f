"""Shard input: a rank's row groups as jagged batches, read ahead in the background,
behind a data cursor that advances only when a step commits.

`ShardSet` opens and checks a shard set (a `DataError` names what is wrong);
`shard_ranks_for` maps (group g of R, rank k of K) to the shards it reads; `DataCursor` is
the position (epoch, step index) in the run's seeded step order; `BatchLoader.peek()` is the
batch at the cursor and `commit()` moves it (a retried step re-reads the same batch).
"""

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow.parquet as pq
import torch

from dataprep import schema


class DataError(ValueError):
    """The shard set cannot be used as given; the message names the file or setting."""


@dataclass
class Batch:
    values: torch.Tensor  # [N] input item ids, all samples back to back
    offsets: torch.Tensor  # [B+1] sample starts in values
    labels: torch.Tensor  # [N] the next item after each input token
    sample_ids: torch.Tensor  # [B]
    step: int  # row group (step within the epoch) this batch came from
    timestamps: torch.Tensor | None = None  # [N] epoch seconds of each input item; None: the set has none

    @property
    def key(self) -> tuple[int, int]:
        """Names the batch: its row group and first sample id (an ftcore make-up piece reads the
        same row group of another group's shards)."""
        return self.step, int(self.sample_ids[0]) if self.sample_ids.numel() else -1

    @property
    def num_targets(self) -> int:
        return int(self.values.numel())

    @property
    def num_samples(self) -> int:
        return int(self.offsets.numel() - 1)

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]


class ShardSet:
    """A checked shard set: manifest, per-rank files and the evaluation file."""

    REQUIRED = ("sample_id", "step", "items", "target")

    def __init__(self, path: str):
        self.path = path
        if not path:
            raise DataError("no shard set given: pass --shards DIR (a folder written by `python -m dataprep shards`)")
        mpath = os.path.join(path, schema.MANIFEST)
        if not os.path.isdir(path):
            raise DataError(f"shard set {path} not found: build it with `python -m dataprep shards --out {path} ...`")
        if not os.path.isfile(mpath):
            raise DataError(
                f"{mpath} missing: {path} is not a complete shard set (rebuild it with `python -m dataprep shards`)"
            )
        try:
            with open(mpath) as f:
                self.manifest = json.load(f)
        except json.JSONDecodeError as e:
            raise DataError(f"{mpath}: not valid JSON ({e}); rebuild the shard set") from None
        m = self.manifest
        try:
            if m["format_version"] not in schema.READ_VERSIONS:
                raise DataError(
                    f"{mpath}: format_version {m['format_version']}, this trainer reads "
                    f"{' or '.join(map(str, schema.READ_VERSIONS))}; rebuild the shard set"
                )
            self.has_time = schema.has_timestamps(m["format_version"])
            self.world_size = int(m["config"]["world_size"])
            self.max_len = int(m["config"]["max_len"])
            self.num_items = int(m["num_items"])
            self.steps = int(m["steps"])
        except KeyError as e:
            raise DataError(
                f"{mpath}: key {e} missing; rebuild the shard set with `python -m dataprep shards`"
            ) from None
        if self.steps < 1:
            raise DataError(f"{mpath}: the shard set has 0 steps (fewer samples than world_size x batch_size)")
        for rank in range(self.world_size):
            shard = os.path.join(path, schema.shard_file(rank))
            if not os.path.isfile(shard):
                raise DataError(
                    f"{shard} missing: the manifest says world_size={self.world_size}; rebuild the shard set"
                )
        if not os.path.isfile(self.eval_path):
            raise DataError(f"{self.eval_path} missing; rebuild the shard set")

    @property
    def tokens_per_step(self) -> float:
        """Mean input tokens per step over all ranks (manifest counts.tokens / steps)."""
        tokens = self.manifest.get("counts", {}).get("tokens")
        if not tokens:
            raise DataError(
                f"{self.path}: manifest has no counts.tokens; rebuild the shard set or use loss.normalize=step"
            )
        return float(tokens) / self.steps

    @property
    def eval_path(self) -> str:
        return os.path.join(self.path, schema.EVAL_FILE)

    def fingerprint(self) -> str:
        return str(self.manifest.get("input", {}).get("fingerprint", ""))

    def open_rank(self, rank: int) -> pq.ParquetFile:
        f = os.path.join(self.path, schema.shard_file(rank))
        pf = pq.ParquetFile(f)
        missing = [
            c for c in self.REQUIRED + ((schema.TIMESTAMPS,) if self.has_time else ()) if c not in pf.schema_arrow.names
        ]
        if missing:
            raise DataError(f"{f}: columns {missing} missing; rebuild the shard set")
        if pf.num_row_groups != self.steps:
            raise DataError(
                f"{f}: {pf.num_row_groups} row groups, the manifest says {self.steps} steps; "
                "the set is damaged, rebuild it"
            )
        return pf


def shard_ranks_for(world_size: int, replica_groups: int, group: int, group_size: int, rank: int) -> list[int]:
    """Shard files read by rank `rank` of replica group `group` (R groups of K ranks)."""
    procs = replica_groups * group_size
    if world_size % procs != 0:
        raise DataError(
            f"shard set built for world_size={world_size} cannot feed {replica_groups} replica "
            f"group(s) x {group_size} rank(s) = {procs} processes: rebuild it with "
            f"--world-size {procs} (or a multiple of it)"
        )
    m = world_size // procs
    first = (group * group_size + rank) * m
    return list(range(first, first + m))


class DataCursor:
    """Position in the run: epoch and index into that epoch's step order."""

    def __init__(self, steps_per_epoch: int, seed: int):
        self.steps_per_epoch, self.seed = steps_per_epoch, seed
        self.epoch, self.index = 0, 0
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            if epoch == 0:
                self._orders[0] = list(range(self.steps_per_epoch))
            else:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._orders[epoch] = torch.randperm(self.steps_per_epoch, generator=g).tolist()
        return self._orders[epoch]

    def ahead(self, i: int) -> tuple[int, int]:
        """(epoch, index) i steps after the cursor."""
        flat = self.epoch * self.steps_per_epoch + self.index + i
        return divmod(flat, self.steps_per_epoch)

    def row_group(self, epoch: int, index: int) -> int:
        return self.order(epoch)[index]

    def advance(self) -> None:
        self.epoch, self.index = self.ahead(1)
        self._orders = {e: o for e, o in self._orders.items() if e >= self.epoch}

    @property
    def consumed(self) -> int:
        """Steps committed since the start of the run."""
        return self.epoch * self.steps_per_epoch + self.index

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "steps_per_epoch": self.steps_per_epoch}

    def load_state_dict(self, state: dict) -> None:
        if int(state["steps_per_epoch"]) != self.steps_per_epoch:
            raise DataError(
                f"checkpoint was taken on a shard set with {state['steps_per_epoch']} steps per "
                f"epoch, this one has {self.steps_per_epoch}: resume on the same shard set"
            )
        self.epoch, self.index, self.seed = int(state["epoch"]), int(state["index"]), int(state["seed"])


def read_batch(files: list[pq.ParquetFile], row_group: int) -> Batch:
    """One step's rows from each file, concatenated, as a jagged batch with next-item labels
    (and each item's timestamp when the set has them)."""
    value_parts: list[torch.Tensor] = []
    length_parts: list[torch.Tensor] = []
    target_parts: list[torch.Tensor] = []
    ids: list[torch.Tensor] = []
    times: list[torch.Tensor] = []
    for pf in files:
        timed = schema.TIMESTAMPS in pf.schema_arrow.names
        t = pf.read_row_group(row_group, columns=["sample_id", "items", "target"] + [schema.TIMESTAMPS] * timed)
        if timed:
            ts = t.column(schema.TIMESTAMPS).combine_chunks().flatten()
            times.append(torch.from_numpy(ts.to_numpy().astype("int64")))
        items = t.column("items").combine_chunks()
        value_parts.append(torch.from_numpy(items.flatten().to_numpy().astype("int64")))
        length_parts.append(torch.from_numpy(items.value_lengths().to_numpy().astype("int64")))
        target_parts.append(torch.from_numpy(t.column("target").to_numpy().astype("int64")))
        ids.append(torch.from_numpy(t.column("sample_id").to_numpy().astype("int64")))
    values, lengths, targets = torch.cat(value_parts), torch.cat(length_parts), torch.cat(target_parts)
    del value_parts, length_parts, target_parts  # the parts are copies: free them now
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    labels = torch.empty_like(values)
    labels[:-1] = values[1:]  # next item inside the sample ...
    labels[offsets[1:] - 1] = targets  # ... and the sample's target after its last item
    return Batch(values, offsets, labels, torch.cat(ids), row_group, torch.cat(times) if times else None)


class BatchLoader:
    """Prefetching reader of one process's shard files, driven by a `DataCursor`."""

    def __init__(self, shardset: ShardSet, shard_ranks: list[int], cursor: DataCursor, prefetch: int = 2):
        self.shardset, self.files = shardset, [shardset.open_rank(r) for r in shard_ranks]
        self.shard_ranks, self.cursor, self.prefetch = shard_ranks, cursor, prefetch
        self._others: dict[tuple[int, ...], list[pq.ParquetFile]] = {}  # another group's files, opened once
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-reader") if prefetch else None
        self._pending: dict[tuple[int, int], Future] = {}

    def _read(self, epoch: int, index: int) -> Batch:
        return read_batch(self.files, self.cursor.row_group(epoch, index))

    def peek(self, at: tuple[int, int] | None = None, ranks: list[int] | None = None) -> Batch:
        """The batch at the cursor (the cursor does not move); schedules the next ones.

        `at` = (epoch, index) other than the cursor's: an ftcore make-up step, read now;
        `ranks` other than this loader's: from those shard files (another group's make-up work).
        """
        if ranks is not None and ranks != self.shard_ranks:
            key = tuple(ranks)
            if key not in self._others:
                self._others[key] = [self.shardset.open_rank(r) for r in ranks]
            return read_batch(self._others[key], self.cursor.row_group(*(at or self.cursor.ahead(0))))
        here = self.cursor.ahead(0)
        if at is not None and at != here:
            return self._read(*at)
        if self._pool is None:
            return self._read(*here)
        for pos in [p for p in self._pending if p < here]:  # the cursor jumped (a heal loaded a state)
            self._pending.pop(pos).cancel()
        for i in range(self.prefetch + 1):
            pos = self.cursor.ahead(i)
            if pos not in self._pending:
                # row_group() is resolved here, on the caller's thread, so the
                # background thread never touches the cursor.
                rg = self.cursor.row_group(*pos)
                self._pending[pos] = self._pool.submit(read_batch, self.files, rg)
        return self._pending[here].result()

    def peek_ahead(self, i: int = 1) -> Batch:
        """The batch i steps after the cursor (the one expected then), from the read-ahead
        that `peek` scheduled when it covers it."""
        pos = self.cursor.ahead(i)
        fut = self._pending.get(pos)
        return fut.result() if fut is not None else self._read(*pos)

    def commit(self) -> None:
        """The step at the cursor was applied: move on and forget its batch."""
        self._pending.pop(self.cursor.ahead(0), None)
        self.cursor.advance()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
