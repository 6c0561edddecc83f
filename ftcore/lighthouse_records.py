"""What the lighthouse knows of a job: its ranks, groups, pending round and health, as records."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ftcore.answers import OvertakenReply, QuorumRefused, StandbyReply
from ftcore.messages import Busy, QuorumRequest

SWEEP_S = 0.05  # health sweeps over every rank (disconnects and reports: at the next tick)
# A job's sweeps take at most this share of the lighthouse's ticker, which serves every job: a
# job of many ranks is swept less often (its own verdicts come later), not at others' expense.
SWEEP_SHARE = 0.1
REPORTED_QUORUMS = 4  # failure probes are kept for this many quorum ids (a report may name any)
# A sweep lets its job's lock go after this many groups: the loop that answers every job waits
# on a big job's lock (its heartbeats, its closed lines) for one slice of its sweep, not all of it.
SWEEP_SLICE = 1024


def in_slices(groups: dict[int, GroupRecord], lock: threading.Lock) -> Iterator[GroupRecord]:
    """The records of `groups`, read under `lock` (the caller holds it), which is let go between
    slices of SWEEP_SLICE. A record replaced meanwhile (a new incarnation) is skipped: the next
    sweep judges its successor. A job of fewer groups is read in one hold, as before."""
    for i, grp in enumerate(list(groups.values())):
        if i and i % SWEEP_SLICE == 0:
            lock.release()
            time.sleep(0)  # a thread waiting for the lock takes it now
            lock.acquire()
        if groups.get(grp.group) is grp:
            yield grp


class RankRecord(NamedTuple):
    """What the lighthouse knows of one rank, as read from its group's columns (GroupRecord.rank)."""

    rank: int
    store: str  # host:port of this rank's TCPStore (rendezvous for cross-group groups)
    heal: str  # host:port of this rank's heal server
    step: int  # committed steps
    last_beat: float
    disconnected: bool
    disconnected_at: float
    beat_lines: int  # open connections it heartbeats on: it died when the last one closed
    answered: tuple[int, int, str] | None  # its last quorum answer: (its step, quorum id, the reply)


# A column of a group's ranks' values: a tuple of blocks of BLOCK values, each a tuple, so that
# a change copies one block and the block list, not every rank's value (a group may have many).
BLOCK = 64


def _column(n: int, value: Any) -> tuple:
    return tuple((value,) * min(BLOCK, n - i) for i in range(0, n, BLOCK))


def _at(column: tuple, r: int) -> Any:
    return column[r // BLOCK][r % BLOCK]


def _put(column: tuple, r: int, value: Any) -> tuple:
    """`column` with `value` at `r`: new tuples (a sweep between slices may hold the old ones)."""
    k, i = divmod(r, BLOCK)
    block = column[k]
    return (*column[:k], (*block[:i], value, *block[i + 1 :]), *column[k + 1 :])


@dataclass(eq=False)
class GroupRecord:
    """What the lighthouse knows of one incarnation of a replica group, its ranks' values held
    as columns indexed by rank: tuples of plain values, replaced whole on a change, which
    CPython's garbage collector stops tracking (arrays, lists and dicts it tracks). A job of
    65,536 groups is then 65,536 tracked objects, not three times as many, and a full
    collection, which stops every job, is shorter (BENCHMARKS.md, "one job's size")."""

    group: int
    incarnation: int
    world: int  # ranks per group (K)
    healthy: bool = False
    left: bool = False
    leaving: bool = False  # a rank said goodbye: the group is ending cleanly, rank by rank
    relay: bool = False  # its relay speaks for all its ranks as rank 0 (ftcore/relay.py)
    probed: float = -math.inf  # failed by a failure probe begun then: healthy only once heard since
    registered: int = 0  # its ranks the lighthouse knows (heard, and not gone by a goodbye)
    # each rank's values, as columns (_column): when it was last heard (None: not registered),
    # when its last heartbeat line closed (None: one is open, or it never had one), its
    # TCPStore's and heal server's host:port, its committed steps, its open heartbeat lines (it
    # died when the last one closed), its last quorum answer (its step, quorum id, the reply:
    # Job._answered_again)
    beats: tuple = ()
    closed_at: tuple = ()
    stores: tuple = ()
    heals: tuple = ()
    steps: tuple = ()
    lines: tuple = ()
    answers: tuple = ()

    def __post_init__(self) -> None:
        n = self.world
        self.beats, self.closed_at, self.answers = _column(n, None), _column(n, None), _column(n, None)
        self.stores, self.heals, self.steps, self.lines = _column(n, ""), _column(n, ""), _column(n, 0), _column(n, 0)

    # ---- its ranks -----------------------------------------------------------------------
    def has(self, r: int) -> bool:
        return _at(self.beats, r) is not None

    def ranks(self) -> Iterator[int]:
        """The registered ranks, in order."""
        for k, block in enumerate(self.beats):
            for i, t in enumerate(block):
                if t is not None:
                    yield k * BLOCK + i

    def rank(self, r: int) -> RankRecord | None:
        """Rank r's values together (None: not registered)."""
        if not self.has(r):
            return None
        closed = _at(self.closed_at, r)
        return RankRecord(
            r, self.store(r), self.heal(r), self.rank_step(r), _at(self.beats, r), closed is not None, closed or 0.0,
            _at(self.lines, r), self.answered(r),
        )  # fmt: skip

    def store(self, r: int) -> str:
        return _at(self.stores, r)

    def heal(self, r: int) -> str:
        return _at(self.heals, r)

    def rank_step(self, r: int) -> int:
        return _at(self.steps, r)

    def answered(self, r: int) -> tuple[int, int, str] | None:
        return _at(self.answers, r)

    def beat(self, r: int, store: str, heal: str, step: int, now: float, new_line: bool) -> bool:
        """Rank r registers or is heard (a heartbeat or a request): True if its line had closed."""
        if store and store != self.store(r):
            self.stores = _put(self.stores, r, store)
        if heal and heal != self.heal(r):
            self.heals = _put(self.heals, r, heal)
        if step > self.rank_step(r):  # a late heartbeat may carry an older step
            self.steps = _put(self.steps, r, step)
        if new_line:
            self.lines = _put(self.lines, r, _at(self.lines, r) + 1)
        self.registered += not self.has(r)
        self.beats = _put(self.beats, r, now)
        if _at(self.closed_at, r) is None:
            return False
        self.closed_at = _put(self.closed_at, r, None)
        return True

    def line_closed(self, r: int, now: float) -> bool:
        """One of rank r's heartbeat lines closed: True once none is left (it is disconnected)."""
        self.lines = _put(self.lines, r, max(_at(self.lines, r) - 1, 0))
        if _at(self.lines, r):
            return False
        self.closed_at = _put(self.closed_at, r, now)
        return True

    def answer(self, r: int, answered: tuple[int, int, str] | None) -> None:
        self.answers = _put(self.answers, r, answered)

    def drop(self, r: int) -> int | None:
        """Rank r said goodbye: forget it (registered again, it starts afresh); its last step
        (None: it was not registered)."""
        if not self.has(r):
            return None
        step = self.rank_step(r)
        self.registered -= 1
        self.beats, self.closed_at = _put(self.beats, r, None), _put(self.closed_at, r, None)
        self.steps, self.lines = _put(self.steps, r, 0), _put(self.lines, r, 0)
        self.answer(r, None)
        return step

    # ---- what the sweep asks ---------------------------------------------------------------
    @property
    def speakers(self) -> int:
        """The ranks that speak to the lighthouse: all of them, or the relay alone."""
        return 1 if self.relay else self.world

    @property
    def step(self) -> int:
        return min((self.rank_step(r) for r in self.ranks()), default=0)

    @property
    def disconnected(self) -> bool:
        """A registered rank's last connection closed (known crashed)."""
        return any(t is not None for block in self.closed_at for t in block)

    def last_beat(self) -> float:
        return max((t for block in self.beats for t in block if t is not None), default=-math.inf)

    def standing(self, incarnation: int) -> bool:
        """Still this incarnation, not left, no rank's connection closed (not known crashed)."""
        return self.incarnation == incarnation and not self.left and not self.disconnected

    def heard_within(self, now: float, quiet: float, since: float) -> bool:
        """No rank disconnected, each heard within `quiet` of `now` and at `since` or after."""
        beats = [t for block in self.beats for t in block if t is not None]
        return not self.disconnected and all(now - t <= quiet and t >= since for t in beats)

    def lost_rank(self, now: float, probe: float, heartbeat_timeout: float | None) -> int | None:
        """A rank this incarnation has lost for good (connection closed for longer than a
        reconnect takes, or silent past the heartbeat timeout, None: silence does not count):
        the group must restart."""
        for r in self.ranks():
            closed = _at(self.closed_at, r)
            if (closed is not None and now - closed > probe) or (
                heartbeat_timeout is not None and now - _at(self.beats, r) > heartbeat_timeout
            ):
                return r
        return None

    def silent_since(self, t: float) -> bool:
        """Not heard since `t`, and no connection closed (a silence, not a crash)."""
        return not self.disconnected and self.last_beat() < t

    def why_failed(self, now: float, heartbeat_timeout: float) -> str:
        """What the lighthouse saw when it declared this group failed (its failure event)."""
        if self.disconnected:
            return "connection closed"
        if self.registered < self.speakers or now - self.first_beat() > heartbeat_timeout:
            return "heartbeat timeout"
        return "not heard within the failure probe"

    def first_beat(self) -> float:
        """When its least recently heard rank was heard."""
        return min((t for block in self.beats for t in block if t is not None), default=math.inf)


Answer = StandbyReply | OvertakenReply | QuorumRefused
# hands a quorum request's answer to its waiter: a quorum (its JSON text, encoded for the rank) or another answer
Deliver = Callable[[str | Answer], None]


@dataclass
class Request:
    """A pending quorum request (from a checked QuorumRequest)."""

    group: int
    rank: int
    incarnation: int
    step: int
    t: float  # monotonic time of arrival
    last_quorum: int  # the last quorum id this rank trained in
    last_lighthouse_id: str  # ... the lighthouse that formed it, and its members
    last_key: str  # (identity_key of its members)
    deliver: Deliver
    deadline: float = math.inf  # monotonic: past it the request is answered with a timeout
    busy: Busy | None = None  # its last step's compute (ftcore/pace.py)
    idle: int = -1  # the quorum id of its last step if nobody had work in it (only absent groups' is left)
    last_settled: bool = False  # its last quorum was the settled one (Quorum.settled)

    @classmethod
    def of(cls, ask: QuorumRequest, incarnation: int, now: float, deliver: Deliver, timeout: float) -> Request:
        """The pending form of a checked request that arrived `now`."""
        i = ask.info
        return cls(
            i.group,
            i.rank,
            incarnation,
            i.step,
            now,
            i.quorum_id,
            ask.quorum_lighthouse_id,
            ask.quorum_key,
            deliver,
            now + timeout,
            ask.busy,
            ask.idle,
            ask.quorum_settled,
        )


class StaleIncarnation(Exception):
    """A message from a process of a group incarnation that has been replaced."""


@dataclass
class Pending:
    """The round being gathered: who asks, which groups are complete, since and until when."""

    pending: dict[int, dict[int, Request]] = field(default_factory=dict)  # group -> rank -> request
    complete: set[int] = field(default_factory=set)  # groups all of whose ranks ask: formation looks at these
    start: float | None = None  # arrival of the round's first request
    deadline: float = math.inf  # the earliest deadline among its requests
    need: int = 1  # complete groups before an arrival tries to form it (quorum.arrivals_needed)
    last_wait_event: float = 0.0
    probed: float = -math.inf  # when a round last probed the quorum's members (once per round)


@dataclass(frozen=True)
class Probe:
    """A failure probe: begun at `t` by a report (or a round kept waiting) of the groups `by`.
    The members of its quorum not heard from within the probe fail, unless the accusers went
    silent too (then the silence says more about this lighthouse: quorum.isolated)."""

    t: float
    by: frozenset[int]


@dataclass
class Health:
    """The job's health as the last sweep found it, and what changes the next quorum."""

    healthy: set[int] = field(default_factory=set)  # groups healthy (kept with GroupRecord.healthy)
    failed: list[int] = field(default_factory=list)  # members of the current quorum that are not (for heartbeats)
    reports: dict[int, list[Probe]] = field(default_factory=dict)  # quorum_id -> its last two failure probes
    force_new: bool = False  # a data-plane failure: the next quorum gets a new id, whoever is in it
    last_sweep: float = 0.0
    sweep_asked: bool = False  # a disconnect, a report, a returning rank: sweep at the next tick
    sweep_cost: float = 0.0  # seconds the last sweep took (its job's share of the ticker)
    isolated: bool = False  # most groups went silent at once: this lighthouse is likely cut off
    grace_until: float = 0.0  # after an isolation: silence is not judged before this

    def sweep_due(self, now: float) -> bool:
        """Every SWEEP_S, or at the next tick when asked (a disconnect, a report, a returning
        group), however many asked meanwhile (one sweep for a burst of closed lines); never
        sooner than SWEEP_SHARE of the ticker allows the last sweep's cost."""
        wait = max(0.0 if self.sweep_asked else SWEEP_S, self.sweep_cost * (1 / SWEEP_SHARE - 1))
        return now - self.last_sweep >= wait

    def swept(self, now: float, cost: float) -> None:
        self.last_sweep, self.sweep_asked, self.sweep_cost = now, False, cost

    def probes(self, qid: int, current: int | None) -> list[Probe]:
        """Quorum qid's failure probes. Those of REPORTED_QUORUMS quorum ids are kept: the
        `current` quorum's always (the sweep reads its), and the last ones reported (a
        restarted lighthouse may resume the quorum a report names)."""
        probes = self.reports.setdefault(qid, [])
        drop = len(self.reports) - REPORTED_QUORUMS
        for old in sorted(k for k in self.reports if k not in (qid, current))[: max(drop, 0)]:
            del self.reports[old]
        return probes
