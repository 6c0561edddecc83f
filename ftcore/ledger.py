"""The ledger of committed batches, and the check that every sample was trained once per epoch.
Every rank appends one JSON line per committed step; `healed_to` and `resumed_to` markers
supersede records a heal or a resume replaced. The rules: docs/ftcore.md, "ledger"."""

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable

SYNC_EVERY = 16  # records between fdatasyncs (markers are synced at once)


def ranges(ids: Iterable[int]) -> list[list[int]]:
    """Sorted ids as inclusive [first, last] runs: [1,2,3,7] -> [[1,3],[7,7]]."""
    out: list[list[int]] = []
    for i in sorted(ids):
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def expand(rs: list[list[int]]) -> list[int]:
    return [i for a, b in rs for i in range(a, b + 1)]


class Ledger:
    def __init__(self, folder: str, group: int, rank: int):
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"group-{group:03d}-rank-{rank:03d}.jsonl")
        self.group, self.rank = group, rank
        # O_APPEND: one write per line, so a killed process leaves whole lines (at worst a torn
        # last one, on a full disk or a power loss). A writer that finds one ends it and says so,
        # so that a torn line anywhere else is damage the reader refuses.
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._unsynced = 0
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            self._write({"torn_line_ended": True, "writer": [group, rank]}, sync=True, prefix=b"\n")

    def record(
        self,
        step: int,
        epoch: int,
        row_group: int,
        kind: str,
        contributors: Iterable[int],
        quorum_id: int,
        sample_ids: Iterable[int] | None = None,
        pieces: Iterable[tuple[int, int, int, int]] = (),
    ) -> None:
        """One committed step. `pieces` (a make-up step): (helper, owner, epoch, row group),
        the helper trained the owner's row group; `sample_ids`: what this writer trained."""
        line = {
            "step": step,
            "epoch": epoch,
            "row_group": row_group,
            "kind": kind,
            "contributors": sorted(contributors),
            "quorum_id": quorum_id,
            "writer": [self.group, self.rank],
            "ranges": ranges(sample_ids) if sample_ids is not None else None,
        }
        if pieces:
            line["pieces"] = [list(p) for p in pieces]
        self._write(line)

    def healed(self, step: int) -> None:
        """This rank's state was replaced by a peer's at `step`: its earlier records are superseded."""
        self._write({"healed_to": step, "writer": [self.group, self.rank]}, sync=True)

    def resumed(self, step: int) -> None:
        """This process joined the job at `step`: this writer's earlier records of steps >= it are void."""
        self._write({"resumed_to": step, "writer": [self.group, self.rank]}, sync=True)

    def _write(self, rec: dict, sync: bool = False, prefix: bytes = b"") -> None:
        """Markers are made durable at once; records every SYNC_EVERY (each step is recorded by
        every writer of every contributing group, so a power loss costs at most a tail that the
        other writers also hold, and `check` says so rather than passing)."""
        os.write(self._fd, prefix + (json.dumps(rec) + "\n").encode())
        self._unsynced += 1
        if sync or self._unsynced >= SYNC_EVERY:
            os.fdatasync(self._fd)
            self._unsynced = 0

    def close(self) -> None:
        os.fdatasync(self._fd)
        os.close(self._fd)


def read(folder: str) -> list[tuple[dict, bool]]:
    """Every record as (record, superseded): superseded records precede a heal of their writer;
    records a `resumed_to` marker voids are left out."""
    out = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".jsonl"):
            continue
        recs: list[tuple[dict, bool]] = []
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        for n, raw in enumerate(lines, 1):
            try:
                rec = json.loads(raw)
                if not isinstance(rec, dict):
                    raise ValueError("not an object")
            except ValueError:
                # a torn line ends a killed writer's file, or its successor ended it with a marker
                if n == len(lines) or b"torn_line_ended" in lines[n]:
                    continue
                raise LedgerError(
                    f"{path}, line {n}: not a ledger record, and not a killed writer's last line: the ledger is damaged"
                ) from None
            if "torn_line_ended" in rec:
                continue
            if "healed_to" in rec:
                recs = [(r, True) for r, _ in recs]
            elif "resumed_to" in rec:
                recs = [(r, sup) for r, sup in recs if r["step"] < rec["resumed_to"]]
            else:
                recs.append((rec, False))
        out += recs
    return out


class LedgerError(AssertionError):
    """The ledger shows a sample trained twice, never, or inconsistent records."""


def check(
    folder: str,
    *,
    steps_per_epoch: int,
    num_groups: int,
    ranks_per_group: int,
    epochs: int,
    sample_ids: Callable[[int, int], list[int]] | None = None,
    partial_last: bool = False,
) -> dict:
    """Prove exactly-once: every (shard, row group) trained exactly once per epoch.

    With `sample_ids(shard_rank, row_group)`, also every sample id once per epoch, and the
    writers' own ranges must match the shards. `partial_last`: a step budget ended the last
    epoch midway, so there (and in any epoch past `epochs`) a batch trained twice is an error,
    one never trained is not. Returns a summary; raises LedgerError.
    """
    steps: dict[int, dict] = {}
    records = read(folder)
    # A writer that was healed may have recorded a step its peers discarded (it was cut off
    # mid-commit); the heal overwrote that state, so its earlier records count only where
    # no current record exists. Current records must agree exactly.
    for rec, superseded in sorted(records, key=lambda x: x[1]):
        key = {k: rec.get(k) for k in ("epoch", "row_group", "kind", "contributors", "pieces")}
        seen = steps.setdefault(rec["step"], key)
        if seen != key:
            if superseded:
                continue
            raise LedgerError(f"step {rec['step']}: writers disagree: {seen} vs {key}")
        if sample_ids is not None and rec["ranges"] is not None:
            g, k = rec["writer"]
            o, rg = next(((o, rg) for h, o, _, rg in _pieces(key) if h == g), (g, rec["row_group"]))
            want = ranges(sample_ids(o * ranks_per_group + k, rg))
            if rec["ranges"] != want:
                raise LedgerError(
                    f"step {rec['step']}: group {g} rank {k} recorded ids {rec['ranges'][:3]}..., "
                    f"the shard has {want[:3]}..."
                )
    missing_steps = [s for s in range(max(steps, default=-1) + 1) if s not in steps]
    if missing_steps:
        raise LedgerError(f"committed steps {missing_steps[:10]} have no ledger record")
    trained: dict[int, Counter] = {e: Counter() for e in range(epochs)}
    credited = [(o, e, rg) for rec in steps.values() for h, o, e, rg in _pieces(rec) if h in rec["contributors"]]
    for o, e, rg in credited:  # the owner's shards (rank k's) at that row group
        trained.setdefault(e, Counter()).update((o * ranks_per_group + k, rg) for k in range(ranks_per_group))
    expected = {(s, rg) for s in range(num_groups * ranks_per_group) for rg in range(steps_per_epoch)}
    for e in sorted(set(range(epochs)) | set(trained)):
        complete = e < epochs - 1 or (e == epochs - 1 and not partial_last)
        _check_epoch(e, trained[e], expected if complete else None, sample_ids)
    return {
        "steps": len(steps),
        "makeup_steps": sum(r["kind"] == "makeup" for r in steps.values()),
        "epochs": epochs,
        "batches": sum(sum(c.values()) for c in trained.values()),
    }


def _check_epoch(
    e: int, trained: Counter, expected: set | None, sample_ids: Callable[[int, int], list[int]] | None
) -> None:
    """Epoch e's (shard, row group) counts: none twice, and with `expected` (a complete epoch)
    none of it missing; with `sample_ids`, no sample id twice either. Raises LedgerError."""
    twice = [x for x, c in trained.items() if c > 1]
    never = sorted(expected - set(trained)) if expected is not None else []
    if twice or never:
        raise LedgerError(f"epoch {e}: (shard, row group) trained twice {twice[:5]}, never {never[:5]}")
    if sample_ids is not None:
        ids = Counter(i for s, rg in trained for i in sample_ids(s, rg))
        dup = [i for i, c in ids.items() if c > 1]
        if dup:
            raise LedgerError(f"epoch {e}: sample ids {dup[:5]} trained more than once")


def _pieces(rec: dict) -> list[tuple[int, int, int, int]]:
    """(helper, owner, epoch, row group) of a step's record: a make-up step's own list, else
    every contributor trained its own shards' row group (regular steps, and older ledgers)."""
    if rec.get("pieces"):
        return [(int(h), int(o), int(e), int(rg)) for h, o, e, rg in rec["pieces"]]
    return [(g, g, rec["epoch"], rec["row_group"]) for g in rec["contributors"]]
