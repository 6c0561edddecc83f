"""The training loop's seam to fault tolerance.

The loop treats every step as a transaction (see ../shared/DESIGN.md, ftcore):
start_quorum -> forward/backward -> allreduce -> should_commit. `LocalReplica` is the
one-replica-group case: nothing to agree on, every step commits. The ftcore-backed
implementation plugs in behind the same methods.
"""

from typing import Protocol

import torch


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
