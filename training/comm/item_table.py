"""The trainer's item table sharded row-wise across the K ranks of a replica group.

`comm.embedding = "sharded"` swaps SeqRec's `item_emb` (an nn.Embedding) for
`ShardedItemTable`: rank k keeps rows [k*B, (k+1)*B) of the very table the replicated model
starts from, and every lookup (histories in the model, then targets, then the shared
negatives in the loss: the order compute consumes them, `Stage` HISTORY < CANDIDATE <
NEGATIVE) is an all-to-all through the group's transport.

Why the gradients are deferred: the replicated table sums, per row, the dense gradient of
each lookup in the order autograd delivers them, and the group then SUMs the ranks. Here
each lookup's per-row gradient is added into one buffer over the step's unique ids in the
same delivery order, and `flush_grads` (after backward) sends that buffer to the owners in
one all-to-all, where rank 0's part is added before rank 1's. With 2 ranks every float
addition happens in the same order as in the replicated run: bitwise equal updates.

ftcore: rank k of every replica group holds the same rows, so ft.allreduce (FTAR) averages
the shard like any dense parameter of rank k.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from training.comm.scheduler import Stage
from training.comm.sharded_embedding import LookupPlan, ShardedEmbedding, gather_full_weight


class ShardedItemTable(ShardedEmbedding):
    """`item_emb` of a SeqRec, row-sharded; `weight` is this rank's shard."""

    def __init__(self, full_weight: torch.Tensor, transport, sched=None, padding_idx: int | None = 0):
        super().__init__(full_weight.shape[0], full_weight.shape[1], transport, sharding="row",
                         padding_idx=padding_idx, full_weight=full_weight.detach().cpu())
        self.sched = sched                      # CommScheduler: exposed-comm records per stage
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []   # (unique ids, grads) per lookup
        self._stages = iter(())
        self.grad_sink = self._defer

    def step_lookups(self) -> None:
        """Call before a step's forward: its lookups are history, candidates, negatives (in order)."""
        self._stages = iter((Stage.HISTORY, Stage.CANDIDATE, Stage.NEGATIVE))

    def _submit(self, name: str, stage: Stage, fn):
        if self.sched is None:
            return fn()
        return self.sched.submit(name, stage, fn).future.result()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        stage = next(self._stages, Stage.NEGATIVE)
        name = stage.name.lower()
        plan = self._submit(f"{name}_ids", stage, lambda: self.exchange_ids(self.plan(ids.cpu())))
        rows = self._submit(f"{name}_rows", stage, lambda: self.exchange_rows(plan, self.gather_rows(plan)))
        return self.attach(plan, rows).to(ids.device)

    def _defer(self, plan: LookupPlan, grad_unique: torch.Tensor) -> None:
        self._pending.append((plan.unique, grad_unique))

    def flush_grads(self) -> None:
        """Collective (every rank of the group, after backward): the step's embedding
        gradients to their owners, SUMmed into the shard's .grad."""
        pending, self._pending = self._pending, []
        if pending:
            ids = torch.unique(torch.cat([u for u, _ in pending]), sorted=True)
            buf = torch.zeros(ids.numel(), self.dim, dtype=pending[0][1].dtype)
            for u, g in pending:   # delivery order, one add per row per lookup, as autograd does
                buf.index_add_(0, torch.searchsorted(ids, u), g)
        else:
            ids, buf = torch.zeros(0, dtype=torch.int64), torch.zeros(0, self.dim, dtype=self.weight.dtype)
        if self.padding_idx is not None:
            buf[ids == self.padding_idx] = 0
        plan = self._submit("emb_grad_ids", Stage.EMB_GRAD, lambda: self.exchange_ids(self.plan(ids)))
        recv = self._submit("emb_grad", Stage.EMB_GRAD, lambda: self.exchange_grads(plan, buf))
        self.accumulate(plan, recv)

    def full_weight(self) -> torch.Tensor:
        """Collective: the unsharded table (every rank gets it)."""
        return gather_full_weight(self)


def grad_norm_sq(shard: torch.nn.Parameter) -> torch.Tensor:
    """The squared norm of the whole table's gradient: shard norms all-reduced in the group."""
    g = shard.grad if shard.grad is not None else torch.zeros(())
    sq = torch.linalg.vector_norm(g.detach().double()).pow(2).reshape(1)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    return sq[0]
