"""An embedding table sharded row-wise across the K ranks of one replica group.

Rank k holds rows [k*B, (k+1)*B). A lookup is
two all-to-alls: input dist (`exchange_ids`, no weights needed, so it can run a batch early)
and output dist (`exchange_rows`). Backward sums each unique id's gradient locally and sends
it to its owner, added in source-rank order: the shard's grad is already the group's SUM
(not all-reduced again; `grad_scale` if the loop averages).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ftcore import collectives as coll


@dataclass
class LookupPlan:
    """One lookup in flight: what this rank asked for and what its peers asked of it."""

    shape: tuple  # ids.shape
    unique: torch.Tensor  # sorted unique global ids
    inverse: torch.Tensor  # position of each id in `unique`
    send_splits: list[int]  # unique ids per owner rank
    send_local: torch.Tensor  # `unique` as row numbers inside the owner's shard
    recv_splits: list[int] | None = None  # ids asked of me by each rank
    recv_local: torch.Tensor | None = None  # those ids as rows of my shard
    extra: dict = field(default_factory=dict)


class _Lookup(torch.autograd.Function):
    """Attach rows fetched by all-to-all to autograd; backward routes grads to the owners."""

    @staticmethod
    def forward(ctx, weight, unique_rows, emb, plan):
        ctx.emb, ctx.plan = emb, plan
        return unique_rows.index_select(0, plan.inverse).view(*plan.shape, unique_rows.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        emb, plan = ctx.emb, ctx.plan
        g = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        # same kernel as nn.Embedding's backward: per-row sums in occurrence order
        grad_u = torch.ops.aten.embedding_dense_backward(g, plan.inverse, plan.unique.numel(), -1, False)
        if emb.padding_idx is not None:
            grad_u[(plan.unique == emb.padding_idx).to(grad_u.device)] = 0
        emb.grad_sink(plan, grad_u)
        return None, None, None, None


class ShardedEmbedding(nn.Module):
    """One table of `num_embeddings` x `dim`, this rank's shard in `self.weight`."""

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        transport,
        *,
        padding_idx: int | None = None,
        init_std: float = 0.02,
        seed: int = 0,
        full_weight: torch.Tensor | None = None,
        grad_scale: float = 1.0,
    ):
        super().__init__()
        self.num_embeddings, self.dim = num_embeddings, dim
        self.transport = transport
        self.rank, self.world_size = transport.rank, transport.world_size
        self.padding_idx, self.grad_scale = padding_idx, grad_scale
        self.block = -(-num_embeddings // self.world_size)
        lo = min(self.rank * self.block, num_embeddings)
        hi = min(lo + self.block, num_embeddings)
        self.row_range = (lo, hi)
        if full_weight is None:
            # Every rank draws the whole table from one seed and keeps its rows, so the
            # sharded model starts identical to the unsharded one whatever K is.
            full_weight = reference_weight(num_embeddings, dim, seed, init_std, padding_idx)
        self.weight = nn.Parameter(full_weight[lo:hi].clone())
        self.grad_sink: Callable[[LookupPlan, torch.Tensor], None] = self._grad_blocking

    # ---- local pieces (no communication)
    def plan(self, ids: torch.Tensor) -> LookupPlan:
        """Made on the host; the ids to send and the inverse go to the shard's device."""
        ids = ids.detach().to("cpu", torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(
                f"embedding ids must lie in [0, {self.num_embeddings}); got "
                f"[{int(ids.min())}, {int(ids.max())}] (check num_items in the config)"
            )
        unique, inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
        owner = torch.div(unique, self.block, rounding_mode="floor")
        local = unique - owner * self.block
        splits = torch.bincount(owner, minlength=self.world_size).tolist()
        dev = self.weight.device
        return LookupPlan(tuple(ids.shape), unique, inverse.to(dev), splits, local.to(dev))

    def gather_rows(self, plan: LookupPlan) -> torch.Tensor:
        """Owner side: the rows the peers asked for, read from the current weights."""
        assert plan.recv_local is not None, "exchange_ids(plan) first"
        return self.weight.detach().index_select(0, plan.recv_local)

    def attach(self, plan: LookupPlan, unique_rows: torch.Tensor) -> torch.Tensor:
        return _Lookup.apply(self.weight, unique_rows, self, plan)

    def accumulate(self, plan: LookupPlan, recv_grads: torch.Tensor):
        """Owner side: add the grads sent back by every rank (source-rank order) into .grad."""
        assert plan.recv_local is not None, "exchange_ids(plan) first"
        if self.weight.grad is None:
            self.weight.grad = torch.zeros_like(self.weight)
        if self.grad_scale != 1.0:
            recv_grads = recv_grads * self.grad_scale
        self.weight.grad.index_add_(0, plan.recv_local, recv_grads)

    # ---- communication pieces (run on the scheduler's comm thread, or inline)
    def exchange_ids(self, plan: LookupPlan) -> LookupPlan:
        """Input dist: split sizes first (so owners can size buffers), then the ids."""
        plan.recv_splits = self.transport.exchange_sizes(plan.send_splits)
        plan.recv_local = self.transport.all_to_all(plan.send_local, plan.send_splits, plan.recv_splits).wait()
        return plan

    def exchange_rows(self, plan: LookupPlan, rows: torch.Tensor) -> torch.Tensor:
        """Output dist: the owners' rows back to the ranks that asked, in `unique` order."""
        return self.transport.all_to_all(rows, plan.recv_splits, plan.send_splits).wait()

    def exchange_grads(self, plan: LookupPlan, grad_unique: torch.Tensor) -> torch.Tensor:
        return self.transport.all_to_all(grad_unique, plan.send_splits, plan.recv_splits).wait()

    def _grad_blocking(self, plan: LookupPlan, grad_unique: torch.Tensor):
        self.accumulate(plan, self.exchange_grads(plan, grad_unique))

    # ---- the blocking path: everything inline
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        plan = self.exchange_ids(self.plan(ids))
        return self.attach(plan, self.exchange_rows(plan, self.gather_rows(plan)))


def reference_weight(
    num_embeddings: int, dim: int, seed: int = 0, init_std: float = 0.02, padding_idx: int | None = None
) -> torch.Tensor:
    """The unsharded table a ShardedEmbedding with the same arguments starts from."""
    w = torch.randn(num_embeddings, dim, generator=torch.Generator().manual_seed(seed)) * init_std
    if padding_idx is not None:
        w[padding_idx] = 0
    return w


def gather_full_weight(emb: ShardedEmbedding, group=None) -> torch.Tensor:
    """All shards concatenated into the unsharded table (checkpoints, evaluation)."""
    sizes = coll.all_gather(torch.tensor([emb.weight.shape[0]]), kind=coll.CONTROL, group=group)
    m = int(max(s.item() for s in sizes))
    w = emb.weight.detach()
    pad = w.new_zeros(m, emb.dim)
    pad[: w.shape[0]] = w
    bufs = coll.all_gather(pad, kind=coll.DATA, group=group)
    return torch.cat([b[: int(s.item())] for b, s in zip(bufs, sizes, strict=True)])
