"""The training loop's seam to fault tolerance.

The loop treats every step as a transaction (see ../shared/DESIGN.md, ftcore):
start_quorum -> forward/backward -> allreduce -> should_commit. `LocalReplica` is the
one-replica-group case: nothing to agree on, every step commits. `FTReplica` is the
ftcore-backed one, chosen by `make_replica` when the launcher (training/launch.py) set
FTCORE_LIGHTHOUSE: the step protocol of ftcore.manager, with `TrainState` as the state
a recovering replica group receives (model, optimizer, scheduler, step, data cursor,
RNG), a ledger of committed batches in OUT/../ledger, and the group's final
parameters and optimizer state in OUT/state.safetensors (tensor-only) for the
launcher's per-group checksum.
"""

import os
from typing import Any, Protocol

import torch

LEDGER_DIR = "ledger"


class ReplicaSync(Protocol):
    def start_quorum(self) -> None: ...
    def allreduce(self, tensors: list[torch.Tensor]) -> None: ...
    def should_commit(self) -> bool: ...
    def lr_scale(self) -> float: ...


class LocalReplica:
    """A single replica group: averaging across groups is the identity."""

    def start_quorum(self) -> None:
        pass

    def allreduce(self, tensors: list[torch.Tensor]) -> None:
        pass

    def should_commit(self) -> bool:
        return True

    def lr_scale(self) -> float:
        return 1.0

    def finish(self) -> None:
        pass


class FTReplica:
    """One rank of one replica group of an FT-HSDP job (ftcore.manager underneath)."""

    def __init__(self, state: Any, topology: Any, out: str | None = None):
        import torch.distributed as dist

        from ftcore import ledger, manager

        self.state, self.topo = state, topology
        cfg = manager.config_from_env()
        self.out = out or os.environ.get("FTREC_OUT")
        if self.out and not cfg.records:
            os.makedirs(os.path.join(self.out, "records"), exist_ok=True)
            cfg.records = os.path.join(self.out, "records", f"rank-{cfg.rank}-inc-{cfg.incarnation}.jsonl")
        group_pg = dist.group.WORLD if (dist.is_available() and dist.is_initialized()) else None
        self.manager = manager.Manager(cfg, self._state_dict, self._load_state_dict, group_pg=group_pg,
                                       step=int(state.step), faults=manager.faults_from_env())
        self.ledger = (ledger.Ledger(os.path.join(os.path.dirname(os.path.abspath(self.out)), LEDGER_DIR),
                                     cfg.group, cfg.rank) if self.out else None)
        self._pos: tuple[int, int] | None = None

    # ---- the state a recovering group receives ------------------------------------------
    def _state_dict(self) -> dict:
        return self.state.state_dict()

    def _load_state_dict(self, tree: dict) -> None:
        self.state.load_state_dict(tree)

    # ---- the step protocol --------------------------------------------------------------
    def start_quorum(self) -> None:
        c = self.state.cursor
        self._pos = (c.epoch, c.index)  # the batch this step trains (the cursor moves on commit)
        self.manager.start_quorum()

    def allreduce(self, tensors: list[torch.Tensor]) -> None:
        self.manager.allreduce([t for t in tensors if t is not None])

    def should_commit(self) -> bool:
        ok = self.manager.should_commit()
        if self.ledger is not None:
            if self.manager.healed_step is not None:
                self.ledger.healed(self.manager.healed_step)
            q = self.manager.quorum
            if ok and q is not None:
                epoch, index = (self.state.cursor.epoch, self.state.cursor.index) if self.manager.healing \
                    else self._pos
                live = set(q["groups"]) - {int(h) for h in q["heal"]}
                self.ledger.record(self.manager.step - 1, epoch, self.state.cursor.row_group(epoch, index),
                                   "regular", live, q["quorum_id"])
        return ok

    def lr_scale(self) -> float:
        return self.manager.lr_scale()

    def finish(self) -> None:
        """Write the group's final parameters and optimizer state (tensor-only) and leave."""
        from ftcore import tensorfile

        if self.out and self.topo.rank == 0:
            tensorfile.save({"model": self.state.model.state_dict(), "optimizer": self.state.optimizer.state_dict()},
                            os.path.join(self.out, "state.safetensors"), {"step": str(self.manager.step)})
        self.manager.shutdown()


def make_replica(state: Any, topology: Any) -> ReplicaSync:
    """ftcore's replica when launched by training/launch.py, else the single-group no-op."""
    if not os.environ.get("FTCORE_LIGHTHOUSE"):
        return LocalReplica()
    return FTReplica(state, topology)
