"""The training loop's seam to FreeScale communication: `GroupComm`.

It gives the trainer the replica group's gradient SUM through the configured transport
(`allreduce_grads`), bubble accounting of each step's phases (fed by metrics.StepTimer),
`window_metrics()` for the MLflow window and `finish(out)` for the PNG timeline (both
collective). Two channels: the transport has its own process group, fed only by the
scheduler's comm thread; the trainer's own collectives stay on the default group.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

from ftcore import collectives as coll
from ftcore.timeouts import GROUP_COLLECTIVE_TIMEOUT
from training.comm.bubbles import PhaseLog, account, max_arrivals, metrics, plot_timeline
from training.comm.config import CommConfig, choose_transport
from training.comm.scheduler import CommScheduler, Stage
from training.comm.transport import TransportConfig, all_gather_json, make_transport


class GroupComm:
    def __init__(self, cfg: CommConfig, rank: int = 0, device: str | torch.device = "cpu"):
        self.cfg = cfg
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.group = (
            coll.new_group(
                backend=dist.get_backend(), timeout=timedelta(seconds=GROUP_COLLECTIVE_TIMEOUT), device=device
            )
            if self.active
            else None
        )
        kind, self.choice = choose_transport(
            cfg.transport, torch.device(device).type, dist.get_world_size() if self.active else 1
        )
        self.transport = (
            make_transport(TransportConfig(kind=kind), group=self.group, device=str(device)) if self.active else None
        )
        if kind == "smfree" and self.transport is not None and self.transport.name != "smfree":
            self.choice += f"; fell back to collective: {getattr(self.transport, 'fallback_reason', '?')}"
        if self.active and rank == 0:
            print(f"[comm] {self.choice}", flush=True)
        self.timeline = PhaseLog(rank) if cfg.bubbles else None
        self.sched = CommScheduler(cfg.policy, self.timeline)
        self._window_start = 0  # index into timeline.steps of the first step not yet logged
        self._logged_ops = 0

    # ---- step structure (compute thread); t: the caller's timestamp (time.perf_counter), else now
    def step_begin(self, step: int, t: float | None = None):
        self.sched.step = step
        if self.timeline is not None:
            self.timeline.step_begin(step, t)

    def step_end(self, t: float | None = None):
        if self.timeline is not None:
            self.timeline.step_end(t)

    def compute(self, name: str):
        return self.timeline.compute(name) if self.timeline is not None else nullcontext()

    def compute_begin(self, name: str, t: float | None = None):
        """compute_begin/compute_end: the same as `with compute(name)`, for a caller that times
        its phases itself (the trainer's StepTimer)."""
        if self.timeline is not None:
            self.timeline.compute_begin(name, t)

    def compute_end(self, t: float | None = None):
        if self.timeline is not None:
            self.timeline.compute_end(t)

    def abort_step(self):
        """A step that will be retried (no commit): leave it out of the accounting."""
        if self.timeline is not None:
            self.timeline.step_abort()

    # ---- the group's gradient all-reduce
    def allreduce_grads(self, params: list[torch.nn.Parameter], default=None) -> float:
        """SUM the gradients over the group's ranks in one flat buffer; returns seconds blocked.
        With the `collective` transport and `default` given (the trainer's own all-reduce,
        `default(params) -> seconds`), that one runs, unchanged, and is only timed here."""
        if default is not None and (self.transport is None or self.transport.name == "collective"):
            return self.sched.run_inline("dense_grad", Stage.DENSE_GRAD, lambda: default(params)).exposed
        transport = self.transport
        if not self.active or transport is None:
            return 0.0
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        # through the queue: the transport's ops must keep one order on every rank
        op = self.sched.submit("dense_grad", Stage.DENSE_GRAD, lambda: transport.all_reduce(flat).wait())
        self.sched.wait(op)
        i = 0
        for p, g in zip(params, grads, strict=True):
            if p.grad is None:
                p.grad = g
            p.grad.copy_(flat[i : i + g.numel()].view_as(g))
            i += g.numel()
        return op.exposed

    # ---- reporting (collective: every rank of the group calls them at the same point)
    def window_metrics(self) -> dict[str, float]:
        """Bubble metrics of the steps since the last call, averaged over the group's ranks
        (for `tracker.log_metrics` on rank 0). Collective when the group has several ranks."""
        if self.timeline is None:
            return {}
        steps = self.timeline.steps[self._window_start :]
        arrivals = max_arrivals(self.sched, start=self._logged_ops) if self.active else None
        m = metrics(account(steps, self.timeline.rank, arrivals), straggler=self.active)
        for r in self.sched.records():  # exposed comm per op name, per step
            if r["issue"] >= self._logged_ops:
                key = f"comm/exposed/{r['name']}_s"
                m[key] = m.get(key, 0.0) + r["exposed"] / max(1, len(steps))
        # keep only what the PNG needs: a long run must not grow these lists
        keep = self.cfg.timeline_steps
        first_kept = self.timeline.steps[-keep:][0].step if self.timeline.steps else 0
        self.sched.forget(
            min([o.issue for o in self.sched.issued if o.step >= first_kept], default=self.sched._next_issue)
        )
        self.timeline.steps = self.timeline.steps[-keep:]
        self._window_start = len(self.timeline.steps)
        self._logged_ops = self.sched._next_issue
        if self.active:
            keys = sorted(m)
            t = torch.tensor([m[k] for k in keys], dtype=torch.float64)
            coll.all_reduce(t, kind=coll.CONTROL)
            m = {k: float(v) / dist.get_world_size() for k, v in zip(keys, t.tolist(), strict=True)}
        if self.transport is not None:
            m["comm/smfree"] = float(self.transport.name == "smfree")
        return m

    def finish(self, out_dir: str) -> str | None:
        """Gather every rank's timeline and write the PNG of the last `timeline_steps` steps on
        rank 0; returns its path there (None elsewhere). Collective."""
        self.sched.drain()
        self.sched.close()
        if self.timeline is None:
            if self.transport is not None:
                self.transport.close()
            return None
        steps = self.timeline.steps[-self.cfg.timeline_steps :]
        mine = self.timeline.to_json(steps)
        per_rank = all_gather_json(mine) if self.active else [mine]
        arrivals = max_arrivals(self.sched) if self.active else None
        path = None
        if self.timeline.rank == 0 and steps:
            os.makedirs(out_dir, exist_ok=True)
            path = plot_timeline(
                [PhaseLog.from_json(s) for s in per_rank],
                os.path.join(out_dir, "comm_timeline.png"),
                arrivals=arrivals,
                first_step=steps[0].step,
                num_steps=len(steps),
                title="compute / exposed comm / straggler / idle per rank",
            )
        if self.transport is not None:
            self.transport.close()
        return path
