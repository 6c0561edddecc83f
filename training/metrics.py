"""Per-step measurements, aggregated over a window of steps for logging, and the plots.

Each rank records per step its compute time and its collective wait (the bubble); every
log_every steps the ranks all-gather the window and rank 0 makes one MLflow call.
`StepTimer` is the step's one clock, feeding this record and GroupComm's bubble timeline.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from ftcore import collectives as coll
from ftcore.util.files import atomic_writer
from training import distributed
from training.comm.bubbles import fraction  # the one bubble definition

# columns of a rank's per-step record; LOSS is the rank's share of the group's mean loss
COMPUTE, WAIT, STEP_TIME, DATA_WAIT, LOSS = range(5)
COLUMNS = 5


class StepTimes(NamedTuple):
    """One committed step of one rank, in seconds (Window.record's timing columns)."""

    compute: float  # inside compute phases, waits inside them excluded
    wait: float  # blocked in collectives (the bubble)
    step_time: float  # step begin to step end
    data_wait: float  # step begin to the first compute phase (quorum, next batch)


class PhaseSink(Protocol):
    """Who else learns of a step's phase boundaries, at the timer's timestamps (GroupComm)."""

    def step_begin(self, step: int, t: float | None = None) -> None: ...
    def compute_begin(self, name: str, t: float | None = None) -> None: ...
    def compute_end(self, t: float | None = None) -> None: ...
    def step_end(self, t: float | None = None) -> None: ...
    def abort_step(self) -> None: ...


class StepTimer:
    """The step's one clock: read once at each phase boundary, it gives the Window its
    StepTimes and the bubble accounting (`sink`, GroupComm) the same timestamps."""

    def __init__(self, sink: PhaseSink | None = None, clock: Callable[[], float] = time.perf_counter):
        self.sink, self.clock = sink, clock
        self._t0 = self._opened = 0.0
        self._in_compute = False
        self._data_wait: float | None = None
        self._compute = self._wait = 0.0

    def step_begin(self, step: int) -> None:
        self._t0 = self.clock()
        self._in_compute, self._data_wait, self._compute, self._wait = False, None, 0.0, 0.0
        if self.sink is not None:
            self.sink.step_begin(step, self._t0)

    def compute_begin(self, name: str) -> None:
        """A compute phase (forward_backward, optimizer); the first one ends the data wait."""
        self._opened = self.clock()
        if self._data_wait is None:
            self._data_wait = self._opened - self._t0
        self._in_compute = True
        if self.sink is not None:
            self.sink.compute_begin(name, self._opened)

    def compute_end(self) -> None:
        t = self.clock()
        self._compute += t - self._opened
        self._in_compute = False
        if self.sink is not None:
            self.sink.compute_end(t)

    def wait(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, a blocking collective, timed as wait (not compute, inside a compute phase)."""
        t = self.clock()
        try:
            return fn(*args)
        finally:
            self.add_wait(self.clock() - t, in_compute=self._in_compute)

    def add_wait(self, seconds: float, in_compute: bool = False) -> None:
        """Seconds blocked, measured elsewhere (the comm scheduler's exposed time of its ops);
        `in_compute`: they passed inside a compute phase, so they are not compute."""
        self._wait += seconds
        if in_compute:
            self._compute -= seconds

    def abort(self) -> None:
        """The step will be retried (no commit): nothing of it is recorded."""
        self._in_compute = False
        if self.sink is not None:
            self.sink.abort_step()

    def step_end(self) -> StepTimes:
        t = self.clock()
        if self.sink is not None:
            self.sink.step_end(t)
        return StepTimes(self._compute, self._wait, t - self._t0, self._data_wait or 0.0)


@dataclass
class Window:
    steps: list[int] = field(default_factory=list)
    times: list[list[float]] = field(default_factory=list)  # per step: the COLUMNS above
    lr: list[float] = field(default_factory=list)
    samples: float = 0.0  # global (whole replica group)
    tokens: float = 0.0  # global non-padding tokens
    padded: float = 0.0  # global tokens after padding each rank's batch

    def record(
        self,
        step: int,
        loss_share: float,
        lr: float,
        compute: float,
        wait: float,
        step_time: float,
        data_wait: float,
        samples: float,
        tokens: float,
        padded: float,
    ) -> None:
        """One committed step; samples/tokens/padded are the group's totals."""
        self.steps.append(step)
        self.times.append([compute, wait, step_time, data_wait, loss_share])
        self.lr.append(lr)
        self.samples += samples
        self.tokens += tokens
        self.padded += padded

    def record_step(self, step: int, loss_share: float, lr: float, times: StepTimes, counts: torch.Tensor) -> None:
        """`record` with the StepTimer's times and the group's [targets, samples, padded] counts."""
        self.record(
            step,
            loss_share,
            lr,
            **times._asdict(),
            tokens=float(counts[0]),
            samples=float(counts[1]),
            padded=float(counts[2]),
        )


def gather_times(window: Window, stop: bool, proposal: float = 0.0, group=None) -> tuple[torch.Tensor, bool, float]:
    """All ranks' [steps, COLUMNS] records -> [K, steps, COLUMNS], whether any rank asked to
    stop, and rank 0's `proposal` (a number every rank then agrees on).

    Collective: every rank of the group calls it at the same step.
    """
    mine = torch.tensor(window.times, dtype=torch.float64).reshape(-1, COLUMNS)
    flag = torch.zeros((1, COLUMNS), dtype=torch.float64)
    flag[0, 0], flag[0, 1] = (1.0 if stop else 0.0), proposal
    mine = torch.cat([mine, flag])
    if distributed.active():  # timings and flags: control values (ftcore/collectives.py)
        allt = torch.stack(coll.all_gather(mine, kind=coll.CONTROL, group=group))
    else:
        allt = mine[None]
    return allt[:, :-1], bool(allt[:, -1, 0].max() > 0), float(allt[0, -1, 1])


def agree(stop: bool, proposal: float = 0.0, group=None) -> tuple[bool, float]:
    """Whether any rank asked to stop, and rank 0's `proposal`: `gather_times` of no steps.
    Collective: every rank of the group calls it at the same step."""
    _, stop, proposal = gather_times(Window(), stop, proposal, group)
    return stop, proposal


def summarize(window: Window, per_rank: torch.Tensor) -> dict[str, float]:
    """One window -> the metrics logged for its last step."""
    wall = float(per_rank[:, :, STEP_TIME].max(0).values.sum())  # a step lasts as long as its slowest rank
    compute = per_rank[:, :, COMPUTE]
    out = {
        "train/loss": float(per_rank[:, :, LOSS].sum(0).mean()),
        "train/lr": window.lr[-1],
        "train/samples_per_s": window.samples / wall if wall else 0.0,
        "train/tokens_per_s": window.tokens / wall if wall else 0.0,
        "train/step_time_s": wall / per_rank.shape[1],
        "train/padding_fraction": 1.0 - window.tokens / window.padded if window.padded else 0.0,
        "train/bubble_fraction": fraction(float(compute.sum()), wall * per_rank.shape[0]),
    }
    for k in range(per_rank.shape[0]):
        out[f"rank{k}/compute_s"] = float(per_rank[k, :, COMPUTE].mean())
        out[f"rank{k}/wait_s"] = float(per_rank[k, :, WAIT].mean())
        out[f"rank{k}/data_wait_s"] = float(per_rank[k, :, DATA_WAIT].mean())
    return out


@dataclass
class History:
    """What rank 0 keeps for the end-of-run plots: loss per step, per-rank step times."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    rank_times: list[torch.Tensor] = field(default_factory=list)  # [K, steps, COLUMNS] per window
    samples: float = 0.0
    tokens: float = 0.0
    padded: float = 0.0

    def add(self, window: Window, per_rank: torch.Tensor) -> None:
        self.samples += window.samples
        self.tokens += window.tokens
        self.padded += window.padded
        self.steps += window.steps
        self.loss += per_rank[:, :, LOSS].sum(0).tolist()
        self.rank_times.append(per_rank)


def run_summary(history: History) -> dict[str, float]:
    """Whole-run throughput: non-padding tokens/s over the slowest rank's step times, and more."""
    if not history.rank_times:
        return {}
    t = torch.cat(history.rank_times, dim=1)
    wall = float(t[:, :, STEP_TIME].max(0).values.sum())
    compute = t[:, :, COMPUTE]
    return {
        "steps": int(t.shape[1]),
        "step_seconds": wall,
        "tokens": history.tokens,
        "tokens_per_s": history.tokens / wall if wall else 0.0,
        "samples_per_s": history.samples / wall if wall else 0.0,
        "padding_fraction": 1.0 - history.tokens / history.padded if history.padded else 0.0,
        "compute_s_per_step": float(compute.mean()),
        "wait_s_per_step": float(t[:, :, WAIT].mean()),
        "bubble_fraction": fraction(float(compute.sum()), wall * t.shape[0]),
    }


def plot(history: History, path: str) -> str | None:
    """PNG: training loss per step, and compute / step time per rank per step."""
    if not history.steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = torch.cat(history.rank_times, dim=1)
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    a.plot(history.steps, history.loss, lw=0.8)
    a.set_ylabel("train loss")
    a.set_title("loss and per-rank step times")
    for k in range(times.shape[0]):
        b.plot(history.steps, times[k, :, STEP_TIME].numpy() * 1e3, lw=0.6, label=f"rank {k} step")
        b.plot(history.steps, times[k, :, COMPUTE].numpy() * 1e3, lw=0.6, ls="--", label=f"rank {k} compute")
    b.set_xlabel("step")
    b.set_ylabel("ms")
    b.legend(fontsize=7)
    fig.tight_layout()
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, dpi=90, format="png")
    plt.close(fig)
    return path
