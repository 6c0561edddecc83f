"""The trainer's item table behind one interface, `TrainerTable`, whatever comm.embedding says.

`ShardedItemTable`: rank k keeps rows [k*B, (k+1)*B) and looks rows up by all-to-all,
submitted before the forward pass in need order; its gradient reaches the owners in one
deferred all-to-all (bitwise equal to the replicated table with 2 ranks).
`ReplicatedItemTable`: the model's own nn.Embedding. `RowwiseItemTable`: that embedding with
a sparse gradient of the touched rows (optim.item_optimizer = "rowwise_adam", training/rows.py).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from ftcore import collectives as coll
from training.comm.scheduler import CommOp, CommScheduler, Stage
from training.comm.sharded_embedding import LookupPlan, ShardedEmbedding, gather_full_weight
from training.rows import group_sum, merge, pack, touched, unpack


@dataclass
class _Ahead:
    """The batch expected next: its id exchanges, submitted a step early."""

    key: object
    ids: list[torch.Tensor]
    plans: list[LookupPlan]
    ops: list[CommOp]


FEATURES = (("history", Stage.HISTORY), ("candidate", Stage.CANDIDATE), ("negative", Stage.NEGATIVE))
# the batch expected next, asked for only by a table that prefetches: (key, [histories, targets])
Ahead = Callable[[], tuple[Any, list[torch.Tensor]]]


class TrainerTable(Protocol):
    """What the training loop asks of its item table, sharded or replicated."""

    sharded: bool
    per_rank: tuple[str, ...]  # what a rank > 0 writes into its own checkpoint file

    @property
    def rank_params(self) -> tuple[nn.Parameter, ...]:
        """Parameters that differ per rank by design: not broadcast, not in the group all-reduce."""
        ...

    @property
    def row_params(self) -> tuple[nn.Parameter, ...]:
        """Parameters whose gradient is touched rows (a sparse tensor) the table carries
        itself: not in the group's flat all-reduce; across groups as `cross_group_grads`."""
        ...

    def start_lookups(self, key: Any, ids: list[torch.Tensor], ahead: Ahead) -> None: ...
    def start_grads(self) -> None: ...
    def take_lookup_wait(self) -> float: ...
    def finish_grads(self) -> float: ...
    def cross_group_grads(self, params: Sequence[nn.Parameter]) -> list[torch.Tensor | None]: ...
    def after_cross_group(self) -> None: ...
    def clip_grads_(self, params: Sequence[nn.Parameter], max_norm: float) -> None: ...
    def full_model(self, model: nn.Module, is_main: bool) -> nn.Module | None: ...
    def to_checkpoint(self, state: dict, meta: dict) -> None: ...
    def from_checkpoint(self, state: dict) -> dict: ...
    def summary(self) -> dict | None: ...


class ReplicatedItemTable:
    """The model's own nn.Embedding as a `TrainerTable`: its gradient joins the dense
    all-reduce, torch clips, the model and its checkpoints hold the whole table."""

    sharded = False
    per_rank: tuple[str, ...] = ("rng",)
    rank_params: tuple[nn.Parameter, ...] = ()
    row_params: tuple[nn.Parameter, ...] = ()

    def start_lookups(self, key: Any, ids: list[torch.Tensor], ahead: Ahead) -> None:
        pass

    def start_grads(self) -> None:
        pass

    def take_lookup_wait(self) -> float:
        return 0.0

    def finish_grads(self) -> float:
        return 0.0

    def cross_group_grads(self, params: Sequence[nn.Parameter]) -> list[torch.Tensor | None]:
        """What ftcore's FTAR averages across replica groups: the gradients themselves."""
        return [p.grad for p in params]

    def after_cross_group(self) -> None:
        pass

    def clip_grads_(self, params: Sequence[nn.Parameter], max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    def full_model(self, model: nn.Module, is_main: bool) -> nn.Module | None:
        return model

    def to_checkpoint(self, state: dict, meta: dict) -> None:
        pass

    def from_checkpoint(self, state: dict) -> dict:
        return state

    def summary(self) -> dict | None:
        return None


class TouchedRows:
    """A table whose gradient is the rows a step touched, a coalesced sparse tensor
    (optim.item_optimizer = "rowwise_adam"): across replica groups it travels in this
    group's FTAR slot (training/rows.py); `cross` = (slot, groups, rows bound), None with
    one group. Shared by `RowwiseItemTable` and a `ShardedItemTable` under rowwise_adam."""

    weight: nn.Parameter
    rowwise: bool = False
    cross: tuple[int, int, int] | None = None
    ids: torch.Tensor  # this step's touched rows (row numbers of `weight`) and their gradient
    rows: torch.Tensor
    _bufs: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.ids, self.rows = ids, rows
        self.weight.grad = torch.sparse_coo_tensor(
            ids[None], rows, tuple(self.weight.shape), is_coalesced=True, check_invariants=False
        )

    def cross_group_grads(self, params: Sequence[nn.Parameter]) -> list[torch.Tensor | None]:
        """The other gradients, then this group's rows in its slot (when there are groups)."""
        if not self.rowwise:
            return [p.grad for p in params]
        out: list[torch.Tensor | None] = [p.grad for p in params if p is not self.weight]
        self._bufs = None
        if self.cross is not None:
            slot, groups, cap = self.cross
            self._bufs = pack(self.ids, self.rows, slot, groups, min(cap, self.weight.shape[0]))
            out += list(self._bufs)
        return out

    def after_cross_group(self) -> None:
        """The averaged slots back into the table's sparse gradient."""
        if self._bufs is not None:
            self.set_rows(*unpack(*self._bufs))
            self._bufs = None

    def clip_rows_(self, coef: torch.Tensor) -> None:
        self.set_rows(self.ids, self.rows.mul_(coef))


class RowwiseItemTable(TouchedRows, ReplicatedItemTable):
    """The model's nn.Embedding under optim.item_optimizer = "rowwise_adam": its gradient is
    the rows the step touched (sparse=True), summed over the group's ranks and averaged over
    the replica groups as rows (training/rows.py), never as the whole table."""

    rowwise = True

    def __init__(self, emb: nn.Embedding, cross: tuple[int, int, int] | None = None):
        emb.sparse = True  # backward leaves a COO gradient of the looked-up rows
        self.weight = cast(nn.Parameter, emb.weight)
        self.cross = cross
        self.ids = torch.zeros(0, dtype=torch.int64)
        self.rows = torch.zeros(0, emb.embedding_dim)

    @property
    def row_params(self) -> tuple[nn.Parameter, ...]:  # type: ignore[override]
        return (self.weight,)

    def finish_grads(self) -> float:
        """Collective: the group's SUM of touched rows; returns the seconds it took."""
        t = time.perf_counter()
        self.set_rows(*group_sum(*touched(self.weight.grad, self.weight.shape[1])))
        return time.perf_counter() - t

    def clip_grads_(self, params: Sequence[nn.Parameter], max_norm: float) -> None:
        """torch's clip_grad_norm_ over the dense gradients and the touched rows."""
        dense = [p.grad for p in params if p is not self.weight and p.grad is not None]
        norms = [torch.linalg.vector_norm(g) for g in dense] + [torch.linalg.vector_norm(self.rows)]
        total = torch.linalg.vector_norm(torch.stack(norms))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in dense:
            g.mul_(coef)
        self.clip_rows_(coef)


class ShardedItemTable(TouchedRows, ShardedEmbedding):
    """`item_emb` of a SeqRec, row-sharded; `weight` is this rank's shard. A `TrainerTable`.
    `use_rows` (rowwise_adam): the shard's gradient is the rows its peers sent, not the shard."""

    sharded = True
    per_rank: tuple[str, ...] = ("rng", "optimizer")  # rank > 0 also keeps its shard's optimizer state

    def __init__(
        self, full_weight: torch.Tensor, transport, sched: CommScheduler | None = None, padding_idx: int | None = 0
    ):
        super().__init__(
            full_weight.shape[0],
            full_weight.shape[1],
            transport,
            padding_idx=padding_idx,
            full_weight=full_weight.detach(),
        )  # on the model's device
        self.sched = sched or CommScheduler("blocking")
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (unique ids, grads) per lookup
        self._ready: list[tuple[torch.Tensor, LookupPlan, CommOp, CommOp]] = []  # this step's lookups
        self._ahead: _Ahead | None = None
        self._grad_ops: tuple[LookupPlan, CommOp, CommOp] | None = None
        self.prefetch_hits = self.prefetch_misses = 0
        self._lookup_ops: list[CommOp] = []  # lookup ops whose exposed time is not yet taken
        self.lookup_wait_s = self.emb_grad_wait_s = 0.0  # the compute thread's totals, for result.json
        self.grad_sink = self._defer

    @property
    def rank_params(self) -> tuple[nn.Parameter, ...]:
        return (self.weight,)

    @property
    def row_params(self) -> tuple[nn.Parameter, ...]:
        """Rank k of every group holds the same rows: FTAR averages the shard like a dense
        grad, or (rowwise_adam) its touched rows in this group's slot."""
        return (self.weight,) if self.rowwise else ()

    def use_rows(self, cross: tuple[int, int, int] | None) -> None:
        """optim.item_optimizer = "rowwise_adam": keep the received rows, not a dense shard grad."""
        self.rowwise, self.cross = True, cross
        self.set_rows(torch.zeros(0, dtype=torch.int64), self.weight.new_zeros(0, self.dim))
        self.weight.grad = None

    # ---- forward: lookups submitted before the model runs
    def start_lookups(self, key: Any, ids: list[torch.Tensor], ahead: Ahead) -> None:
        """The trainer's step: `start_step` with the batch expected next (`ahead()`)."""
        next_key, next_ids = ahead()
        self.start_step(key, ids, next_key, next_ids)

    def start_step(self, key, ids: list[torch.Tensor], next_key=None, next_ids: list[torch.Tensor] | None = None):
        """Submit this step's lookups: `ids` = [histories, targets, negatives], the order the
        model and the loss call the table; `key` names the batch (its row group). First the
        id exchange of the batch expected next (`next_key`, `next_ids` = [histories, targets]):
        a FIFO queue issues it first, the prioritized one after this step's lookups. Issues
        them all (flush) before returning."""
        ahead, self._ahead = self._ahead, None
        if next_ids is not None:
            self._ahead = self._prefetch(next_key, next_ids)
        if ahead is not None:
            hit = ahead.key == key
            self.prefetch_hits += hit
            self.prefetch_misses += not hit
            if not hit:
                for op in ahead.ops:  # issued a step ago: finished, or about to
                    self.sched.wait(op)
                ahead = None
        self._ready = []
        for i, ((name, stage), t) in enumerate(zip(FEATURES, ids, strict=False)):
            t = t.detach().cpu()
            if ahead is not None and i < len(ahead.plans):  # histories and targets only
                if not torch.equal(ahead.ids[i], t):
                    raise RuntimeError(
                        f"comm: the prefetched {name} ids of batch {key!r} differ from the "
                        "batch's own: the data under one row group changed during the run"
                    )
                plan, ids_op = ahead.plans[i], ahead.ops[i]  # already in _lookup_ops
            else:
                plan = self.plan(t)
                ids_op = self.sched.submit(f"{name}_ids", stage, partial(self.exchange_ids, plan))
                self._lookup_ops.append(ids_op)
            # gather on the comm thread too: after its ids (same stage, later submission)
            rows_op = self.sched.submit(f"{name}_rows", stage, partial(self._serve_rows, plan))
            self._ready.append((t, plan, ids_op, rows_op))
            self._lookup_ops.append(rows_op)
        self.sched.flush()

    def _prefetch(self, key, ids: list[torch.Tensor]) -> _Ahead:
        """The id exchange (input dist) of the batch expected next step: it needs no weights,
        so it runs while this step computes."""
        ids = [t.detach().cpu() for t in ids]
        plans = [self.plan(t) for t in ids]
        ops = [
            self.sched.submit(f"next_{name}_ids", Stage.NEXT_INPUT, partial(self.exchange_ids, p))
            for (name, _), p in zip(FEATURES, plans, strict=False)
        ]
        self._lookup_ops += ops
        return _Ahead(key, ids, plans, ops)

    def _serve_rows(self, plan: LookupPlan) -> torch.Tensor:
        """Output dist: the rows the peers asked of this rank, read now, sent back."""
        return self.exchange_rows(plan, self.gather_rows(plan))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self._ready:  # a lookup outside start_step: inline, through the same ordered queue
            plan = self.sched.wait(
                self.sched.submit("lookup_ids", Stage.HISTORY, lambda: self.exchange_ids(self.plan(ids.cpu())))
            )
            rows = self.sched.wait(
                self.sched.submit(
                    "lookup_rows", Stage.HISTORY, lambda: self.exchange_rows(plan, self.gather_rows(plan))
                )
            )
            return self.attach(plan, rows).to(ids.device)
        t, plan, ids_op, rows_op = self._ready.pop(0)
        if not torch.equal(ids.detach().cpu(), t):
            raise RuntimeError(
                "comm: the model looked up other ids than start_step() submitted "
                "(the order is histories, targets, negatives)"
            )
        rows = self.sched.wait(rows_op)  # just before use: the exposed communication
        self.sched.wait(ids_op)  # finished before its rows (one ordered queue)
        return self.attach(plan, rows).to(ids.device)

    def take_exposed(self) -> float:
        """Seconds the lookups blocked the compute thread (inline under `blocking`, waiting
        for them otherwise), over the lookup ops waited since the last call."""
        done = [op for op in self._lookup_ops if op.waited]
        self._lookup_ops = [op for op in self._lookup_ops if not op.waited]
        return sum(op.exposed for op in done)

    def take_lookup_wait(self) -> float:
        """`take_exposed`, counted into the run's `lookup_wait_s`."""
        waited = self.take_exposed()
        self.lookup_wait_s += waited
        return waited

    # ---- backward: one gradient all-to-all per step
    def _defer(self, plan: LookupPlan, grad_unique: torch.Tensor) -> None:
        self._pending.append((plan.unique, grad_unique))

    def start_grads(self) -> None:
        """Collective (every rank of the group, after backward): submit the step's embedding
        gradients to their owners; `finish_grads` waits and SUMs them into the shard's .grad."""
        pending, self._pending = self._pending, []
        if pending:
            ids = torch.unique(torch.cat([u for u, _ in pending]), sorted=True)  # host
            dev = pending[0][1].device
            buf = torch.zeros(ids.numel(), self.dim, dtype=pending[0][1].dtype, device=dev)
            for u, g in pending:  # delivery order, one add per row per lookup, as autograd does
                buf.index_add_(0, torch.searchsorted(ids, u).to(dev), g)
        else:
            ids = torch.zeros(0, dtype=torch.int64)
            buf = torch.zeros(0, self.dim, dtype=self.weight.dtype, device=self.weight.device)
        if self.padding_idx is not None:
            buf[(ids == self.padding_idx).to(buf.device)] = 0
        plan = self.plan(ids)
        ids_op = self.sched.submit("emb_grad_ids", Stage.EMB_GRAD, lambda: self.exchange_ids(plan))
        grads_op = self.sched.submit("emb_grad", Stage.EMB_GRAD, lambda: self.exchange_grads(plan, buf))
        self._grad_ops = (plan, ids_op, grads_op)
        self.sched.flush()

    def finish_grads(self) -> float:
        """Wait for the gradients `start_grads` sent and add them into the shard's .grad;
        returns the seconds that took (counted into `emb_grad_wait_s`); 0 when none were sent."""
        if self._grad_ops is None:
            if self.rowwise:  # no rows this step
                self.set_rows(torch.zeros(0, dtype=torch.int64), self.weight.new_zeros(0, self.dim))
            return 0.0
        t = time.perf_counter()
        plan, ids_op, grads_op = self._grad_ops
        self._grad_ops = None
        recv = self.sched.wait(grads_op)
        self.sched.wait(ids_op)  # finished before its grads
        if self.rowwise:  # the peers' rows added in source-rank order, as accumulate() does
            assert plan.recv_local is not None
            self.set_rows(*merge([(plan.recv_local, recv * self.grad_scale)], self.dim, recv.dtype))
        else:
            self.accumulate(plan, recv)
        waited = time.perf_counter() - t
        self.emb_grad_wait_s += waited
        return waited

    # ---- the optimizer step
    def clip_grads_(self, params: Sequence[nn.Parameter], max_norm: float) -> None:
        """Clip `params` (the shard among them) to the global norm: dense grads' norm and the
        shard norms all-reduced in the group (collective)."""
        dense = [p.grad for p in params if p is not self.weight and p.grad is not None]
        sq = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in dense])).double() ** 2
        norm = (sq + grad_norm_sq(self.weight)).sqrt().float()
        if not self.rowwise:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            return
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p is not self.weight], max_norm, norm)
        self.clip_rows_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))  # torch's coefficient

    # ---- the whole table: evaluation, model logging, checkpoints (collective)
    def full_weight(self) -> torch.Tensor:
        """Collective: the unsharded table (every rank gets it)."""
        return gather_full_weight(self)

    def full_model(self, model: nn.Module, is_main: bool) -> nn.Module | None:
        """Collective: rank 0 gets a copy of `model` (this table its `item_emb`) with the
        whole table in a plain nn.Embedding; the others get None."""
        full = self.full_weight()
        if not is_main:
            return None
        emb = nn.Embedding(full.shape[0], full.shape[1], padding_idx=self.padding_idx)
        emb.weight.data.copy_(full)
        whole = copy.copy(model)  # shallow: shares the dense modules, owns its item_emb
        whole._modules = dict(model._modules)
        whole.item_emb = emb.to(full.device)
        return whole

    def to_checkpoint(self, state: dict, meta: dict) -> None:
        """Collective: the checkpoint's model holds the full table, as with a replicated one."""
        state["model"]["item_emb.weight"] = self.full_weight()
        meta["embedding"] = "sharded"

    def from_checkpoint(self, state: dict) -> dict:
        """A checkpoint holds the full table (eval and warm start read it): keep this rank's rows."""
        lo, hi = self.row_range
        state["model"]["item_emb.weight"] = state["model"]["item_emb.weight"][lo:hi].clone()
        return state

    def summary(self) -> dict | None:
        """result.json's "comm": the policy, prefetch hits and misses, exposed comm totals."""
        return {
            "policy": self.sched.policy,
            "prefetch_hits": self.prefetch_hits,
            "prefetch_misses": self.prefetch_misses,
            "lookup_wait_s": self.lookup_wait_s,
            "emb_grad_wait_s": self.emb_grad_wait_s,
        }


def grad_norm_sq(shard: torch.nn.Parameter) -> torch.Tensor:
    """The squared norm of the whole table's gradient: shard norms all-reduced in the group."""
    g = shard.grad if shard.grad is not None else torch.zeros((), device=shard.device)
    if g.is_sparse:  # rowwise_adam: the touched rows
        g = g.coalesce().values()
    sq = torch.linalg.vector_norm(g.detach().double()).pow(2).reshape(1)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        coll.all_reduce(sq, kind=coll.DATA)  # data: made and used (clipping) on the device
    return sq[0]
