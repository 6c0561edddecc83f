"""The training loop's own pieces (training/train.py, training/metrics.py): the one step timer
feeds the metrics window and the bubble timeline the same timestamps, and the time budget
fits the lr schedule once and stops the run past its deadline."""

import time

import pytest
import torch

from training import metrics
from training.comm.bubbles import PhaseLog, account
from training.components import TimeBudget
from training.config import OptimConfig, TrainConfig
from training.distributed import Topology
from training.state import WarmupDecay


class Clock:
    """A clock that advances by a given step each time it is read, and counts its readings."""

    def __init__(self):
        self.now, self.reads, self.next = 0.0, 0, 1.0

    def __call__(self) -> float:
        self.reads += 1
        self.now += self.next
        return self.now


def test_one_timer_feeds_the_window_and_the_timeline():
    clock = Clock()
    timeline = PhaseLog(rank=0, clock=lambda: pytest.fail("the timeline read its own clock"))
    sink = _TimelineSink(timeline)
    timer = metrics.StepTimer(sink, clock=clock)
    timer.step_begin(3)  # t=1
    timer.compute_begin("forward_backward")  # t=2: data wait 1
    clock.next = 0.5
    timer.wait(lambda: None)  # t=2.5..3: 0.5 s blocked inside compute
    clock.next = 1.0
    timer.compute_end()  # t=4: compute 2 - 0.5
    timer.add_wait(0.25, in_compute=True)  # a lookup's exposed time, measured by the scheduler
    timer.add_wait(0.75)  # the group all-reduce, outside compute
    timer.compute_begin("optimizer")  # t=5
    timer.compute_end()  # t=6: compute + 1
    times = timer.step_end()  # t=7
    assert times == metrics.StepTimes(
        compute=2.0 - 0.5 - 0.25 + 1.0, wait=0.5 + 0.25 + 0.75, step_time=6.0, data_wait=1.0
    )
    assert clock.reads == 8  # each boundary read once, for both records
    (step,) = timeline.steps
    assert (step.step, step.t0, step.t1) == (3, 1.0, 7.0)
    assert [(i.name, i.t0, i.t1) for i in step.intervals] == [("forward_backward", 2.0, 4.0), ("optimizer", 5.0, 6.0)]
    (acc,) = account(timeline.steps)
    assert acc.compute == 3.0 and acc.step_time == 6.0

    window = metrics.Window()
    window.record_step(3, 0.5, 1e-3, times, torch.tensor([10.0, 2.0, 12.0], dtype=torch.float64))
    assert window.times == [[times.compute, times.wait, times.step_time, times.data_wait, 0.5]]
    assert (window.tokens, window.samples, window.padded) == (10.0, 2.0, 12.0)


def test_an_aborted_step_is_recorded_nowhere():
    timeline = PhaseLog(rank=0)
    timer = metrics.StepTimer(_TimelineSink(timeline))
    timer.step_begin(0)
    timer.compute_begin("forward_backward")
    timer.compute_end()
    timer.abort()
    timer.step_begin(0)
    timer.step_end()
    assert [s.step for s in timeline.steps] == [0] and timeline.steps[0].intervals == []


class _TimelineSink:
    """GroupComm's phase methods over a bare PhaseLog (no process group)."""

    def __init__(self, timeline: PhaseLog):
        self.timeline = timeline

    def step_begin(self, step, t=None):
        self.timeline.step_begin(step, t)

    def compute_begin(self, name, t=None):
        self.timeline.compute_begin(name, t)

    def compute_end(self, t=None):
        self.timeline.compute_end(t)

    def step_end(self, t=None):
        self.timeline.step_end(t)

    def abort_step(self):
        self.timeline.step_abort()


def _budget(minutes: float) -> tuple[TimeBudget, WarmupDecay]:
    schedule = WarmupDecay(OptimConfig(), 1000)
    topo = Topology(rank=0, group_size=1, replica_group=0, num_replica_groups=1, device=torch.device("cpu"))
    return TimeBudget(TrainConfig(max_minutes=minutes, log_every=10), schedule, topo), schedule


def test_the_time_budget_fits_the_schedule_once_then_stops_past_the_deadline(capsys):
    budget, schedule = _budget(0.0)
    assert budget.maybe_fit(10, 1000, time.perf_counter() - 1e6) == (1000, False)  # no budget: never
    budget, schedule = _budget(1.0)
    now = time.perf_counter()
    assert budget.maybe_fit(10, 1000, now - 10.0) == (1000, False)  # under a quarter of 60 s spent
    assert budget.maybe_fit(15, 1000, now - 1e6) == (1000, False)  # not a log step: not checked
    total, stop = budget.maybe_fit(20, 1000, now - 20.0)  # a third spent after 20 steps
    assert not stop and 20 < total < 1000 and abs(total - 20 * 0.95 * 60 / 20) <= 2
    assert schedule.total == total and "schedule fitted to" in capsys.readouterr().out
    assert budget.maybe_fit(30, total, now - 30.0) == (total, False)  # fitted once only
    assert budget.maybe_fit(40, total, now - 61.0) == (total, True)  # past the budget: stop
