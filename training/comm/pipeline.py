"""Batches in flight for a sharded embedding (TorchRec's sparse-dist pipeline, two deep).

Step i, as the training loop runs it:

    nxt = pipe.prefetch(batch[i+1])     # input dist of batch i+1 (ids only; no weights needed)
    lk  = pipe.lookups(cur)             # output dists of batch i, from the current weights
    sched.flush()                       # issue: prioritized -> history, targets, negatives, next ids
    h   = pipe.get(lk, "history")       # wait just before the first layer ...
    ... transformer ...
    pos = pipe.get(lk, "targets")       # ... the loss's embeddings arrived meanwhile
    loss.backward()                     # each feature's grad all-to-all is issued as autograd
                                        #   produces it (targets/negatives first, history last)
    pipe.finish_grads()                 # wait them and add them into the shard's .grad
    optimizer.step(); cur = nxt

The ids all-to-all of batch i+1 runs while batch i computes; the rows of batch i are fetched
after step i-1's optimizer update, so results equal the unpipelined model exactly (no stale
embeddings). Features map to the consumer stage that orders them (`Stage`).

This general form (any features, one grad all-to-all per feature as autograd produces it)
drives bench.py's model. The trainer's item table (item_table.py) runs the same pipeline for
its three lookups but sends the step's embedding grads in one all-to-all after backward, the
price of summing them in the replicated table's order (bitwise equal results).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.comm.scheduler import CommOp, CommScheduler, Stage
from training.comm.sharded_embedding import LookupPlan, ShardedEmbedding


@dataclass
class InFlight:
    """A batch whose input dist is issued: per feature, its plan and the op exchanging ids."""
    plans: dict[str, LookupPlan]
    ops: dict[str, CommOp]


class EmbeddingPipeline:
    def __init__(self, emb: ShardedEmbedding, scheduler: CommScheduler, stages: dict[str, Stage]):
        self.emb, self.sched, self.stages = emb, scheduler, stages
        self._grad_ops: list[tuple[LookupPlan, CommOp]] = []
        emb.grad_sink = self._grad_sink

    def prefetch(self, ids: dict[str, torch.Tensor]) -> InFlight:
        """Plan the lookups of a batch and submit their input dists (issued at the next flush)."""
        plans, ops = {}, {}
        for name, t in ids.items():
            p = self.emb.plan(t)
            plans[name] = p
            ops[name] = self.sched.submit(f"input_dist/{name}", Stage.NEXT_INPUT,
                                          lambda p=p: self.emb.exchange_ids(p))
        return InFlight(plans, ops)

    def lookups(self, batch: InFlight) -> dict[str, tuple[LookupPlan, CommOp]]:
        """Submit the output dists of a prefetched batch, reading the weights as they are now."""
        out = {}
        for name, plan in batch.plans.items():
            self.sched.wait(batch.ops[name])  # prefetched a step ago: normally already done
            rows = self.emb.gather_rows(plan)
            out[name] = (plan, self.sched.submit(f"output_dist/{name}", self.stages[name],
                                                 lambda p=plan, r=rows: self.emb.exchange_rows(p, r)))
        return out

    def get(self, lookups: dict, name: str) -> torch.Tensor:
        """The embeddings of feature `name`, attached to autograd; waits for them first."""
        plan, op = lookups[name]
        return self.emb.attach(plan, self.sched.wait(op))

    def _grad_sink(self, plan: LookupPlan, grad_unique: torch.Tensor):
        op = self.sched.submit("emb_grad", Stage.EMB_GRAD, lambda: self.emb.exchange_grads(plan, grad_unique))
        self.sched.flush()  # issue now: overlaps the rest of the backward pass
        self._grad_ops.append((plan, op))

    def finish_grads(self):
        """Wait for every embedding-grad all-to-all of this step; accumulate in issue order."""
        ops, self._grad_ops = self._grad_ops, []
        for plan, op in sorted(ops, key=lambda po: po[1].issue):
            self.emb.accumulate(plan, self.sched.wait(op))
