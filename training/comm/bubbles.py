"""Bubble accounting: where each rank's step time goes.

Per rank and step: compute (inside compute phases), comm (blocked on a comm op; its
straggler part waits for the last rank to arrive), idle (the gaps). The bubble fraction is
1 - sum(compute) / sum(step time) over ranks. `max_arrivals` all-reduces arrival times once
per window; `metrics()` is the MLflow dict, `plot_timeline()` the PNG. Times are one host's
perf_counter: across hosts the straggler split is not done.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from ftcore import collectives as coll
from ftcore.util.files import atomic_writer


@dataclass
class Interval:
    kind: str  # "compute" | "comm"
    name: str
    t0: float
    t1: float
    issue: int = -1  # comm: the op's issue index (same op on every rank)
    arrival: float = 0.0  # comm: when the op began on this rank


@dataclass
class StepPhases:
    step: int
    t0: float
    t1: float = 0.0
    intervals: list[Interval] = field(default_factory=list)


@dataclass
class StepAccount:
    rank: int
    step: int
    step_time: float
    compute: float
    comm: float  # exposed comm wait, straggler wait included
    straggler: float
    idle: float

    @property
    def bubble_fraction(self) -> float:
        return fraction(self.compute, self.step_time)


class PhaseLog:
    """Records one rank's compute and comm-wait intervals, step by step (compute thread only)."""

    def __init__(self, rank: int = 0, clock=time.perf_counter):
        self.rank, self.clock = rank, clock
        self.steps: list[StepPhases] = []
        self._cur: StepPhases | None = None
        self._compute: list = []  # [name, t0 or None], the outermost open compute interval
        self._depth = 0

    # t: a timestamp of this clock taken by the caller (the trainer's step timer), else now
    def step_begin(self, step: int, t: float | None = None):
        self._cur = StepPhases(step, self.clock() if t is None else t)

    def step_abort(self):
        """Drop the open step (it will be retried)."""
        self._cur, self._compute, self._depth = None, [], 0

    def step_end(self, t: float | None = None):
        if self._cur is not None:
            self._cur.t1 = self.clock() if t is None else t
            self.steps.append(self._cur)
            self._cur = None

    def compute_begin(self, name: str, t: float | None = None):
        self._depth += 1
        if self._depth == 1:  # nested compute counts once, as its outermost interval
            self._compute = [name, self.clock() if t is None else t]

    def compute_end(self, t: float | None = None):
        self._depth -= 1
        if self._depth == 0:
            name, t0 = self._compute
            if t0 is not None:
                self._add(Interval("compute", name, t0, self.clock() if t is None else t))
            self._compute = []

    @contextmanager
    def compute(self, name: str):
        self.compute_begin(name)
        try:
            yield
        finally:
            self.compute_end()

    def comm_begin(self, t: float):
        # a wait inside a compute stage splits it: intervals never overlap
        if self._compute and self._compute[1] is not None:
            self._add(Interval("compute", self._compute[0], self._compute[1], t))
            self._compute[1] = None

    def comm_end(self, t: float, op):
        self._add(Interval("comm", op.name, op.t_wait0, t, op.issue, op.t_start))
        if self._compute:
            self._compute[1] = t

    def _add(self, iv: Interval):
        if self._cur is not None:
            self._cur.intervals.append(iv)

    def to_json(self, steps: list[StepPhases] | None = None) -> list[dict]:
        return [asdict(s) for s in (self.steps if steps is None else steps)]

    @staticmethod
    def from_json(steps: list[dict]) -> list[StepPhases]:
        return [StepPhases(s["step"], s["t0"], s["t1"], [Interval(**i) for i in s["intervals"]]) for s in steps]


def max_arrivals(scheduler, group=None, start: int = 0) -> dict[int, float]:
    """Issue index (>= start) -> latest arrival over the group's ranks. Collective; call it
    on every rank with no comm op in flight (e.g. after a step's last wait)."""
    ops = [o for o in scheduler.issued if o.issue >= start]
    arr = torch.tensor([o.t_start for o in ops], dtype=torch.float64)
    n = torch.tensor([arr.numel()])
    n_max = n.clone()
    coll.all_reduce(n_max, kind=coll.CONTROL, op=dist.ReduceOp.MAX, group=group)
    if int(n_max) != int(n):
        raise RuntimeError(
            f"ranks issued different numbers of comm ops ({int(n)} vs {int(n_max)}): "
            "every rank must run the same step code"
        )
    coll.all_reduce(arr, kind=coll.CONTROL, op=dist.ReduceOp.MAX, group=group)
    return {o.issue: float(t) for o, t in zip(ops, arr.tolist(), strict=True)}


def _overlap(a0, a1, b0, b1) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def account(steps: list[StepPhases], rank: int = 0, arrivals: dict[int, float] | None = None) -> list[StepAccount]:
    """Per-step compute / comm / straggler / idle of one rank."""
    out = []
    for s in steps:
        ivs = sorted(s.intervals, key=lambda i: i.t0)
        compute = sum(i.t1 - i.t0 for i in ivs if i.kind == "compute")
        comm = sum(i.t1 - i.t0 for i in ivs if i.kind == "comm")
        straggler = 0.0
        if arrivals:
            for i in ivs:
                if i.kind == "comm" and i.issue in arrivals:
                    straggler += _overlap(i.t0, i.t1, i.arrival, arrivals[i.issue])
        idle, t = 0.0, s.t0
        for i in ivs:
            idle += max(0.0, i.t0 - t)
            t = max(t, i.t1)
        idle += max(0.0, s.t1 - t)
        out.append(StepAccount(rank, s.step, s.t1 - s.t0, compute, comm, straggler, idle))
    return out


def fraction(compute_s: float, step_s: float) -> float:
    """The bubble fraction, ftrec's one definition: the share of the ranks' step time not spent
    computing, 1 - sum(compute) / sum(step time) over ranks and steps (exposed comm, straggler
    wait and idle are all bubble; for a pure straggler it is 1 - mean/max). comm/bubble_fraction
    and the timeline (here), train/bubble_fraction and result.json (training/metrics.py) use it."""
    return 1.0 - compute_s / step_s if step_s > 0 else 0.0


def bubble_fraction(accounts: list[StepAccount]) -> float:
    """`fraction` over whatever ranks and steps are given."""
    return fraction(sum(a.compute for a in accounts), sum(a.step_time for a in accounts))


def per_step_bubble(accounts: list[StepAccount]) -> dict[int, float]:
    by_step: dict[int, list[StepAccount]] = {}
    for a in accounts:
        by_step.setdefault(a.step, []).append(a)
    return {s: bubble_fraction(v) for s, v in sorted(by_step.items())}


def metrics(accounts: list[StepAccount], prefix: str = "comm/", straggler: bool = True) -> dict[str, float]:
    """Mean per step and rank of each part, and the bubble fraction: for MLflow log_metrics.
    `straggler` False: the layout cannot show one (one rank a group), so it is left out, not 0."""
    n = max(1, len(accounts))
    parts = [k for k in ("step_time", "compute", "comm", "straggler", "idle") if straggler or k != "straggler"]
    m = {f"{prefix}{k}_s": sum(getattr(a, k) for a in accounts) / n for k in parts}
    m[f"{prefix}bubble_fraction"] = bubble_fraction(accounts)
    return m


COLOURS = {"compute": "#2e7d32", "comm": "#c62828", "straggler": "#ef6c00", "idle": "#bdbdbd"}


def plot_timeline(
    steps_by_rank: list[list[StepPhases]],
    path: str,
    arrivals: dict[int, float] | None = None,
    first_step: int | None = None,
    num_steps: int = 5,
    title: str = "",
) -> str:
    """PNG of a window of steps: one row per rank; idle grey, compute green, exposed comm red
    (its straggler part orange). Written atomically; returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_steps = sorted({s.step for steps in steps_by_rank for s in steps})
    if first_step is None:
        first_step = all_steps[0] if all_steps else 0
    window = set(range(first_step, first_step + num_steps))
    sel = [[s for s in steps if s.step in window] for steps in steps_by_rank]
    # Steps are drawn back to back: what happens between two steps (evaluation, another
    # run's steps in an interleaved benchmark) is not part of either step.
    shift, x = {}, 0.0
    for step in sorted({s.step for steps in sel for s in steps}):
        here = [s for steps in sel for s in steps if s.step == step]
        origin = min(s.t0 for s in here)
        shift[step] = x - origin
        x += max(s.t1 for s in here) - origin
    fig, ax = plt.subplots(figsize=(12, 1.4 + 0.6 * len(sel)))
    for r, steps in enumerate(sel):
        for s in steps:
            d = shift[s.step]
            ax.broken_barh([(s.t0 + d, s.t1 - s.t0)], (r - 0.4, 0.8), color=COLOURS["idle"])
            for i in s.intervals:
                ax.broken_barh([(i.t0 + d, i.t1 - i.t0)], (r - 0.4, 0.8), color=COLOURS[i.kind])
                if i.kind == "comm" and arrivals and i.issue in arrivals:
                    a0, a1 = max(i.t0, i.arrival), min(i.t1, arrivals[i.issue])
                    if a1 > a0:
                        ax.broken_barh([(a0 + d, a1 - a0)], (r - 0.4, 0.8), color=COLOURS["straggler"])
            ax.vlines(s.t0 + d, r - 0.45, r + 0.45, color="black", lw=0.8)
    ax.set_yticks(range(len(sel)), [f"rank {r}" for r in range(len(sel))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (steps back to back; black line = step start)")
    ax.set_title(title or f"steps {first_step}..{first_step + num_steps - 1}")
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    return path
