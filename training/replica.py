"""The training loop's seam to fault tolerance: one replica object per rank.

`LocalReplica` is a single replica group: every step commits. `FTReplica` runs ftcore's
step protocol (start_quorum, allreduce, should_commit); `make_replica` picks it when
FTCORE_LIGHTHOUSE is set. A recovering group receives the `TrainState` and the make-up
schedule. Each group keeps a ledger of committed batches and writes its final state for the
launcher's checksum. The data side: `next_batch`, `advance` (on commit), `data_done`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from training.data import Batch, BatchLoader
from training.distributed import Topology
from training.state import TrainState

if TYPE_CHECKING:
    from ftcore.messages import Quorum
    from ftcore.schedule import Position

LEDGER_DIR = "ledger"


class ReplicaSync(Protocol):
    """Everything the training loop (training/train.py) calls on its replica object."""

    def start_quorum(self) -> None: ...
    def next_batch(self, loader: BatchLoader) -> Batch | None: ...
    def allreduce(self, tensors: Sequence[torch.Tensor | None]) -> None: ...
    def should_commit(self) -> bool: ...
    def lr_scale(self) -> float: ...
    def advance(self, loader: BatchLoader) -> None: ...
    def data_done(self, step: int, steps_total: int) -> bool: ...
    def state_for_checkpoint(self) -> dict: ...
    def load_from_checkpoint(self, meta: dict) -> None: ...
    def window_metrics(self) -> dict: ...
    def finish(self, per_rank: bool = False) -> None: ...


class LocalReplica:
    """A single replica group: averaging across groups is the identity."""

    def start_quorum(self) -> None:
        pass

    def next_batch(self, loader: BatchLoader) -> Batch | None:
        return loader.peek()

    def advance(self, loader: BatchLoader) -> None:
        loader.commit()

    def data_done(self, step: int, steps_total: int) -> bool:
        return step >= steps_total

    def allreduce(self, tensors: Sequence[torch.Tensor | None]) -> None:
        pass

    def should_commit(self) -> bool:
        return True

    def lr_scale(self) -> float:
        return 1.0

    def state_for_checkpoint(self) -> dict:
        return {}  # the data cursor in the checkpoint says it all

    def load_from_checkpoint(self, meta: dict) -> None:
        pass

    def window_metrics(self) -> dict:
        return {}

    def finish(self, per_rank: bool = False) -> None:
        pass  # without ftcore no launcher reads a final state (the trainer's checkpoints stay)


class FTReplica:
    """One rank of one replica group of an FT-HSDP job (ftcore.manager underneath)."""

    def __init__(self, state: TrainState, topology: Topology, out: str | None = None, steps_total: int | None = None):
        import torch.distributed as dist

        from ftcore import ledger, manager
        from ftcore.schedule import MakeupSchedule

        self.state, self.topo = state, topology
        # across groups always gloo (FTCORE_BACKEND, default): CUDA gradients are host-staged by
        # FTAR (ftcore/ftar.py), so a peer's kill -9 or SIGSTOP never hangs or ends this group
        cfg = manager.config_from_env()
        self.out = out or os.environ.get("FTREC_OUT")
        if self.out and not cfg.records:
            os.makedirs(os.path.join(self.out, "records"), exist_ok=True)
            cfg.records = os.path.join(self.out, "records", f"rank-{cfg.rank}-inc-{{incarnation}}.jsonl")
        group_pg = dist.group.WORLD if (dist.is_available() and dist.is_initialized()) else None
        self.manager = manager.Manager(
            cfg,
            self._state_dict,
            self._load_state_dict,
            group_pg=group_pg,
            step=int(state.step),
            faults=manager.faults_from_env(),
        )
        self.ledger = (
            ledger.Ledger(os.path.join(os.path.dirname(os.path.abspath(self.out)), LEDGER_DIR), cfg.group, cfg.rank)
            if self.out
            else None
        )
        # Whole epochs (ceil of steps_total): make-up work is owed per epoch. The schedule starts
        # at the cursor; a resumed run then restores the make-up work owed (load_from_checkpoint).
        c = state.cursor
        epochs = max(1, -(-(steps_total or c.steps_per_epoch) // c.steps_per_epoch))
        self.schedule = MakeupSchedule(c.steps_per_epoch, cfg.num_groups, epochs, seed=c.seed, order=c.order)
        self.schedule.epoch, self.schedule.index = c.epoch, c.index
        self.group = cfg.group
        self._live: set[int] = set()
        self._pos: Position | None = None  # this step's place in the schedule (None: no batch)
        self._committed: Position | None = None  # the last committed step's
        self._ids: list[int] | None = None  # sample ids this group trained this step
        self._joined = False  # the ledger's resumed_to marker is written
        self._budget: int | None = None  # a step budget that ends mid-epoch (data_done)

    # ---- the state a recovering group receives ------------------------------------------
    def _state_dict(self) -> dict:
        return {**self.state.state_dict(), "schedule": self.schedule.state_dict()}

    def _load_state_dict(self, tree: dict) -> None:
        self.state.load_state_dict(tree)
        self.schedule.load_state_dict(tree["schedule"])

    # ---- across a whole-job resume ---------------------------------------------------------
    def state_for_checkpoint(self) -> dict:
        """meta.json's share of FT state: the make-up work owed, which the data cursor cannot
        tell (it says where the epoch is, not which of its batches a group missed)."""
        return {"ftcore": {"schedule": self.schedule.state_dict()}}

    def load_from_checkpoint(self, meta: dict) -> None:
        """Restore the make-up schedule saved with the checkpoint this run resumed from.

        A checkpoint without it (one replica group, or written before ftcore kept it) leaves
        the schedule at the cursor: make-up work owed before it is lost, and said so."""
        from training.checkpoint import CheckpointError

        st = (meta.get("ftcore") or {}).get("schedule")
        where = f"checkpoint step {meta.get('step')}"
        if st is None:
            print(
                f"[ftcore g{self.group}] {where} has no make-up schedule: batches missed before it are not made up",
                flush=True,
            )
            return
        epochs = self.schedule.epochs
        try:
            self.schedule.load_state_dict(st)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{where}: its ftcore schedule does not fit this run ({e}); resume with "
                f"--replica-groups {st.get('num_groups', '?')} on the same shard set"
            ) from None
        self.schedule.epochs = epochs  # this run's length decides when it ends (train.epochs)
        c, sc = self.state.cursor, self.schedule
        if (c.epoch, c.index) != divmod(sc.epoch * sc.steps + sc.index, sc.steps):
            raise CheckpointError(
                f"{where}: its ftcore schedule is at ({sc.epoch}, {sc.index}), its data cursor "
                f"at ({c.epoch}, {c.index}): meta.json does not belong to state.pt"
            )

    # ---- the step protocol --------------------------------------------------------------
    def start_quorum(self) -> None:
        self.manager.start_quorum()

    def next_batch(self, loader: BatchLoader) -> Batch | None:
        """This step's batch from the make-up schedule (waits for the quorum: it decides who
        is live), or None: healing, someone else's make-up step, or nothing can run now."""
        self._pos, self._ids = None, None
        q = self.manager.wait_quorum()
        batch = None
        if q is not None:
            if self.ledger is not None and not self._joined:
                # This process joins the job at the quorum's step: whatever this writer recorded
                # at that step or later (a whole-job resume re-trains them) is void.
                self.ledger.resumed(q.max_step)
                self._joined = True
            self._live = q.live()
            if not self.manager.healing:  # a healing group's schedule arrives with the state
                self._pos = self.schedule.position(self._live, self._spent())
                if self._pos is None:
                    time.sleep(0.05)  # the data is done (or the budget spent): waiting for every group
                elif self.group in self._live and (piece := self._pos.piece(self.group)) is not None:
                    batch = self._read(loader, *piece)
                    self._ids = batch.sample_ids.tolist()
        self.manager.set_work(batch is not None)
        return batch

    def _read(self, loader: BatchLoader, owner: int, epoch: int, row_group: int) -> Batch:
        """This rank's batch of `owner`'s shard files (a make-up piece may be another group's)."""
        from training.data import shard_ranks_for

        t = self.topo
        ranks = shard_ranks_for(loader.shardset.world_size, t.num_replica_groups, owner, t.group_size, t.rank)
        return loader.peek((epoch, loader.cursor.order(epoch).index(row_group)), ranks)

    def advance(self, loader: BatchLoader) -> None:
        """After a commit: the cursor moves past regular steps only (a make-up step read an
        earlier batch), so it stays at the schedule's regular position."""
        if self._committed is not None and self._committed.kind == "regular":
            loader.commit()
        c, sc = loader.cursor, self.schedule
        if (c.epoch, c.index) != divmod(sc.epoch * sc.steps + sc.index, sc.steps):
            raise RuntimeError(
                f"ftcore: data cursor ({c.epoch}, {c.index}) left the make-up schedule ({sc.epoch}, {sc.index})"
            )

    def data_done(self, step: int, steps_total: int) -> bool:
        # Whole epochs end when the schedule, make-up steps included, is done. A step budget
        # short of them (train.max_steps mid-epoch, early stopping at any step) stops at that
        # many committed steps, as a single group does; exactly-once then holds for the
        # complete epochs only. Either way the groups end together (schedule.finished): one
        # behind is healed first, not left alone.
        whole = self.schedule.epochs * self.state.cursor.steps_per_epoch
        self._budget = steps_total if steps_total < whole else None
        return self.schedule.finished(self._spent())

    def _spent(self) -> bool:
        """The step budget that ends mid-epoch (data_done's) is used up."""
        return self._budget is not None and int(self.state.step) >= self._budget

    def allreduce(self, tensors: Sequence[torch.Tensor | None]) -> None:
        q = self.manager.quorum
        self.manager.allreduce([t for t in tensors if t is not None], same_batch=self._same_batch)
        if self.manager.quorum is not None and self.manager.quorum is not q:  # re-run in the survivors' quorum
            self._live = self.manager.quorum.live()

    def _same_batch(self, q: Quorum) -> bool:
        """After a peer failed the exchange: the batch computed for this step is the one the
        schedule names in the survivors' quorum (a regular step: always; make-up: maybe not)."""
        return self._pos is not None and self.schedule.position(q.live()) == self._pos

    def should_commit(self) -> bool:
        """The vote; on commit, the step goes into the ledger and the make-up schedule."""
        ok = self.manager.should_commit()
        if self.ledger is not None and self.manager.healed_step is not None:
            self.ledger.healed(self.manager.healed_step)
        if not ok:
            return False
        pos = self._pos if self._pos is not None else self.schedule.position(self._live, self._spent())  # healed
        if pos is None:
            raise RuntimeError("ftcore: a committed step has no place in the make-up schedule")
        contributors = {h for h in self._live if self.schedule.works(pos, h)}
        if len(contributors) != self.manager.contributors:
            raise RuntimeError(
                f"ftcore: schedule disagrees with FTAR: {sorted(contributors)} contributed "
                f"by the schedule, {self.manager.contributors} by the all-reduce"
            )
        q = self.manager.quorum
        if self.ledger is not None and q is not None:
            self.ledger.record(
                self.manager.step - 1,
                pos.epoch,
                pos.row_group,
                pos.kind,
                contributors,
                q.quorum_id,
                self._ids if self.group in contributors else None,
                pieces=pos.pieces,
            )
        self.schedule.commit(pos, contributors)
        self._committed = pos
        return True

    def lr_scale(self) -> float:
        return self.manager.lr_scale()

    def window_metrics(self) -> dict:
        """The cross-group bubble since the last call, from the lighthouse's pace figures: the
        FTAR time split into waiting for the slowest group (straggler) and the transfer itself,
        and the share of the groups' time not spent computing (1 - mean / slowest compute)."""
        log, self.manager.pace_log = self.manager.pace_log, []
        if not log:
            return {}
        n = len(log)
        return {
            "ft/straggler_s": sum(r[0] for r in log) / n,
            "ft/transfer_s": sum(max(r[1] - r[0], 0.0) for r in log) / n,
            "ft/bubble_fraction": sum(1.0 - r[3] / r[2] for r in log if r[2] > 0) / n,
        }

    def finish(self, per_rank: bool = False) -> None:
        """Write the group's final parameters and optimizer state (tensor-only) and leave.

        per_rank=False: the ranks hold the same state, rank 0 writes OUT/state.safetensors.
        per_rank=True (a sharded item table: each rank holds different rows and their
        optimizer state): every rank writes its own file (ftcore/final_state.py); rank 0's
        metadata says how many there are, so the launcher's checksum covers every shard."""
        from ftcore import final_state, tensorfile  # the launcher reads what this writes

        k = self.topo.rank
        if self.out and (per_rank or k == 0):
            meta = {"step": str(self.manager.step)}
            if per_rank:
                meta.update(rank=str(k), ranks=str(self.topo.group_size))
            tensorfile.save(
                {"model": self.state.model.state_dict(), "optimizer": self.state.optimizer.state_dict()},
                os.path.join(self.out, final_state.file_name(k)),
                meta,
            )
        self.manager.shutdown()


def make_replica(
    state: TrainState, topology: Topology, steps_total: int | None = None, out: str | None = None
) -> ReplicaSync:
    """ftcore's replica when FTCORE_LIGHTHOUSE names a lighthouse (the launcher, or torchrun
    on a cluster), else the single-group no-op. `out`: this group's output folder."""
    if not os.environ.get("FTCORE_LIGHTHOUSE"):
        return LocalReplica()
    return FTReplica(state, topology, out=out, steps_total=steps_total)
