"""The communication scheduler: one ordered queue of comm ops per rank.

Each op carries the compute stage that consumes it (`Stage`); ops go to the comm thread at
`flush()` and are waited on just before their consumer. Policies: `blocking` (run at
submit), `overlapped` (async, FIFO), `prioritized` (async, by stage then submission). The
order is the same on every rank, so collectives never mismatch. Each op records its times;
the compute thread's wait is the exposed communication.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch

from training.comm import COMM_TIMEOUT_S
from training.comm.config import POLICIES


class Stage(IntEnum):
    """The consumer of a comm op, in the order a step needs them."""

    HISTORY = 0  # history embeddings -> the first layer
    CANDIDATE = 1  # target item embeddings -> the loss
    NEGATIVE = 2  # shared negative embeddings -> the loss
    NEXT_INPUT = 3  # input dist (ids) of batch i+1 -> the next step's lookups
    EMB_GRAD = 4  # embedding grads to their owners -> the optimizer step
    DENSE_GRAD = 5  # dense grad all-reduce (backward sync) -> the optimizer step


@dataclass
class CommOp:
    name: str
    stage: Stage
    fn: Callable[[], Any]
    step: int
    seq: int  # submission index on this rank
    issue: int = -1  # issue index on this rank (order handed to the comm thread)
    t_submit: float = 0.0
    t_start: float = 0.0  # began on the comm thread: arrival in the collective
    t_end: float = 0.0
    t_wait0: float = 0.0  # compute thread blocked from ...
    t_wait1: float = 0.0  # ... to: the consumer starts here
    waited: bool = False
    future: Future = field(default_factory=Future, repr=False)

    @property
    def exposed(self) -> float:
        return self.t_wait1 - self.t_wait0


class CommScheduler:
    def __init__(self, policy: str = "prioritized", timeline=None, clock=time.perf_counter):
        if policy not in POLICIES:
            raise ValueError(f"comm.policy = {policy!r} is not one of {POLICIES}; fix the config")
        self.policy, self.timeline, self.clock = policy, timeline, clock
        self.step = 0
        self.ops: list[CommOp] = []  # every op, in submission order
        self.issued: list[CommOp] = []  # every op, in issue order
        self._pending: list[CommOp] = []
        self._next_issue = 0
        self._next_seq = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = None
        if policy != "blocking":
            self._thread = threading.Thread(target=self._run, name="comm-scheduler", daemon=True)
            self._thread.start()

    def submit(self, name: str, stage: Stage, fn: Callable[[], Any]) -> CommOp:
        op = self._new_op(name, stage, fn)
        if self.policy == "blocking":
            self._inline(op)
        else:
            self._pending.append(op)
        return op

    def run_inline(self, name: str, stage: Stage, fn: Callable[[], Any]) -> CommOp:
        """Run `fn` now on the compute thread, recorded like a blocking op (whatever the
        policy): for a collective on another channel than the queue's (the trainer's dense
        all-reduce on the default process group)."""
        op = self._new_op(name, stage, fn)
        self._inline(op)
        op.future.result()  # its error, raised here
        return op

    def drain(self):
        """Wait for every op issued or pending (the end of a run: nothing left in flight)."""
        self.flush()
        for op in [o for o in self.issued if not o.waited]:
            self.wait(op)

    def _new_op(self, name: str, stage: Stage, fn: Callable[[], Any]) -> CommOp:
        op = CommOp(name, Stage(stage), fn, self.step, self._next_seq, t_submit=self.clock())
        self._next_seq += 1
        self.ops.append(op)
        return op

    def _inline(self, op: CommOp):
        # on the compute thread: its whole duration is exposed
        self._issue(op)
        if self.timeline is not None:
            self.timeline.comm_begin(self.clock())
        self._execute(op)
        op.t_wait0, op.t_wait1, op.waited = op.t_start, op.t_end, True
        if self.timeline is not None:
            self.timeline.comm_end(op.t_end, op)

    def flush(self):
        """Hand the pending ops to the comm thread, in issue order."""
        pending, self._pending = self._pending, []
        if self.policy == "prioritized":
            pending.sort(key=lambda o: (o.stage, o.seq))
        for op in pending:
            self._issue(op)
            self._queue.put(op)

    def wait(self, op: CommOp):
        """Block until `op` finished; returns its result. The time blocked is the op's exposed
        comm time, recorded in the timeline. Flushes first if the op was not issued yet."""
        if op.waited:
            return op.future.result()
        if op.issue < 0:
            self.flush()
        op.t_wait0 = self.clock()
        if self.timeline is not None:
            self.timeline.comm_begin(op.t_wait0)
        try:
            result = op.future.result(timeout=COMM_TIMEOUT_S)
        except FutureTimeout:
            raise TimeoutError(
                f"comm op {op.name!r} of step {op.step} did not finish within "
                f"{COMM_TIMEOUT_S:.0f}s (a peer is dead or issued ops in another order; "
                "FTREC_COMM_TIMEOUT_S)"
            ) from None
        finally:
            op.t_wait1 = self.clock()
            op.waited = True
            if self.timeline is not None:
                self.timeline.comm_end(op.t_wait1, op)
        return result

    def forget(self, before_issue: int):
        """Drop the records of waited ops issued before `before_issue` (long runs)."""
        self.issued = [o for o in self.issued if o.issue >= before_issue or not o.waited]
        self.ops = [o for o in self.ops if o.issue >= before_issue or not o.waited]

    def close(self):
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=COMM_TIMEOUT_S)

    def _issue(self, op: CommOp):
        op.issue = self._next_issue
        self._next_issue += 1
        self.issued.append(op)

    def _execute(self, op: CommOp):
        op.t_start = self.clock()
        try:
            op.future.set_result(op.fn())
        except BaseException as e:
            op.future.set_exception(e)
        op.t_end = self.clock()

    def _run(self):
        torch.set_num_threads(1)
        while True:
            op = self._queue.get()
            if op is None:
                return
            self._execute(op)

    def records(self, step: int | None = None) -> list[dict]:
        """Per-op timing in issue order (for logs and bubble accounting)."""
        return [
            {
                "name": o.name,
                "stage": o.stage.name,
                "step": o.step,
                "seq": o.seq,
                "issue": o.issue,
                "t_submit": o.t_submit,
                "t_start": o.t_start,
                "t_end": o.t_end,
                "t_wait0": o.t_wait0,
                "t_wait1": o.t_wait1,
                "exposed": o.exposed if o.waited else 0.0,
            }
            for o in self.issued
            if step is None or o.step == step
        ]
