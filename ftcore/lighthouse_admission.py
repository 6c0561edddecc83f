"""Who holds the lighthouse's connections: admission by job, then by address.

A connection with no valid token yet holds its slot only until someone needs it: once it is
EVICT_AGE_S old (ranks send their token as they connect) a newcomer takes its place, from its
own address past the per-address caps, and from the address holding the most of them when the
lighthouse is full. A connection with a token counts for the job it acts for, which holds at
most max(floor, per_rank x its ranks' heartbeat lines) and, when the lighthouse is full, its
share; past it the job's idle connections close, least recently used first. A request in
flight and a rank's newest line never close, and no job's connections make way for another's
within its bound. `admit` and `settle` are the rule (pure); `AdmissionCounts` keeps the counts they read;
ftcore/lighthouse_http.py closes what they name. docs/ftcore.md, "lighthouse_http"."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

EVICT_AGE_S = 0.5  # a connection that sent no valid token for this long may make way for a new one

Rank = tuple[int, int]  # (group, rank): whose heartbeat line a connection is
C = TypeVar("C", bound=Hashable)


@dataclass(frozen=True)
class Caps:
    """The lighthouse's connection caps (LighthouseConfig's max_connections... fields)."""

    total: int
    per_peer: int
    waiting_per_peer: int  # connections of one address that sent no valid token yet
    job_floor: int  # a job's bound however few ranks it shows
    per_rank: int  # ... and per heartbeat line it holds

    @classmethod
    def of(cls, cfg: Any) -> Caps:
        return cls(
            cfg.max_connections,
            cfg.max_connections_per_peer,
            cfg.max_unauthenticated_per_peer,
            cfg.min_connections_per_job,
            cfg.connections_per_rank,
        )

    def job_bound(self, lines: int, full: bool = False, jobs: int = 0) -> int:
        """A job's bound: by its size, and when the lighthouse is full at most the total over
        the `jobs` holding connections plus one (room for a job that holds none yet)."""
        fair = max(self.job_floor, self.per_rank * lines)
        return min(fair, self.total // (jobs + 1)) if full else fair


@dataclass(frozen=True)
class Waiting:
    """One address's connections that sent no valid token yet."""

    peer: str
    count: int
    oldest_s: float  # the oldest one's age


@dataclass(frozen=True)
class JobLoad:
    """One job's connections: `held` in all, `lines` its ranks' newest heartbeat lines, `idle`
    those with no request in flight that are no rank's newest line."""

    job: str
    held: int
    lines: int
    idle: int


@dataclass(frozen=True)
class Load:
    """The lighthouse's connections as a newcomer from `peer` arrives."""

    total: int
    peer: int  # open from the newcomer's address
    waiting: Waiting | None  # ... of those, without a token yet
    most: Waiting | None  # the address holding the most connections without a token
    oldest: Waiting | None  # the address holding the oldest connection without a token
    jobs: int = 0  # jobs holding connections
    idle: tuple[JobLoad, ...] = ()  # the jobs with idle connections (listed when the lighthouse is full)


@dataclass(frozen=True)
class Admit:
    """Nothing to close."""


@dataclass(frozen=True)
class EvictWaiting:
    """Close `peer`'s oldest connection that sent no valid token."""

    peer: str


@dataclass(frozen=True)
class EvictIdle:
    """Close `job`'s least recently used idle connection."""

    job: str


@dataclass(frozen=True)
class Refuse:
    """Answer 503 with `reason` and close."""

    reason: str


def admit(caps: Caps, peer: str, load: Load) -> Admit | EvictWaiting | EvictIdle | Refuse:
    """What a new connection from `peer` costs: nothing, one connection closed first, or its refusal."""
    own = load.waiting
    own_evictable = own is not None and own.oldest_s >= EVICT_AGE_S
    if own is not None and own.count >= caps.waiting_per_peer:
        if own_evictable:
            return EvictWaiting(peer)
        return Refuse(f"{peer} has {own.count} connections that sent no token yet (--max-unauthenticated-per-peer)")
    if load.peer >= caps.per_peer:
        if own_evictable:
            return EvictWaiting(peer)
        return Refuse(f"{peer} has {caps.per_peer} connections open (--max-connections-per-peer)")
    if load.total < caps.total:
        return Admit()
    for w in (load.most, load.oldest):  # the likeliest flood first; a burst of ranks is younger
        if w is not None and w.oldest_s >= EVICT_AGE_S:
            return EvictWaiting(w.peer)
    excess = [(j.held - caps.job_bound(j.lines, True, load.jobs), j.job) for j in load.idle if j.idle]
    over, job = max(excess, default=(0, ""))
    if over > 0:
        return EvictIdle(job)
    return Refuse(
        f"this lighthouse has {caps.total} connections open (--max-connections), none idle past its job's share"
    )


def settle(caps: Caps, load: JobLoad) -> Admit | EvictIdle | Refuse:
    """A connection has just counted for `load.job` (in `load.held`): within the job's bound
    nothing closes; past it the job's least recently used idle connection does, or, with none
    idle, this connection's request is refused. Never another job's."""
    bound = caps.job_bound(load.lines)
    if load.held <= bound:
        return Admit()
    if load.idle:
        return EvictIdle(load.job)
    return Refuse(
        f"job {load.job!r} holds {load.held - 1} connections, its bound (--min-connections-per-job, "
        f"--connections-per-rank x {load.lines} heartbeat lines), none of them idle"
    )


class _Top:
    """Keys by a count kept elsewhere, the key with the largest at hand; counts move by one (O(1))."""

    def __init__(self) -> None:
        self.buckets: dict[int, dict[str, None]] = {}
        self.top = 0

    def move(self, key: str, old: int, new: int) -> None:
        if old:
            bucket = self.buckets[old]
            del bucket[key]
            if not bucket:
                del self.buckets[old]
        if new:
            self.buckets.setdefault(new, {})[key] = None
        self.top = max(self.top, new)
        while self.top and self.top not in self.buckets:
            self.top -= 1

    def first(self) -> str | None:
        return next(iter(self.buckets[self.top])) if self.top else None


@dataclass
class _Seat:
    peer: str
    job: str | None = None  # the job it last acted for
    busy: bool = False  # a request in flight
    line: Rank | None = None  # the rank whose newest heartbeat line it is


class AdmissionCounts(Generic[C]):
    """The counts admission reads, kept as connections open, show a token, act for a job, take
    and finish requests, become a rank's newest heartbeat line, and close; each O(1). A
    connection it never opened (a relay's: the relay counts its own) is ignored."""

    def __init__(self) -> None:
        self.seats: dict[C, _Seat] = {}
        self.per_peer: Counter[str] = Counter()
        self.waiting: dict[str, dict[C, float]] = {}  # per address, oldest first: when it opened
        self.every_waiting: dict[C, float] = {}  # all addresses' together, oldest first
        self.most = _Top()
        self.held: Counter[str] = Counter()  # per job
        self.idle: dict[str, dict[C, None]] = {}  # per job, least recently used first
        self.lines: dict[str, dict[Rank, C]] = {}  # per job: each rank's newest heartbeat line

    def __len__(self) -> int:
        return len(self.seats)

    def open(self, c: C, peer: str, now: float) -> None:
        self.seats[c] = _Seat(peer)
        self.per_peer[peer] += 1
        pool = self.waiting.setdefault(peer, {})
        pool[c] = self.every_waiting[c] = now
        self.most.move(peer, len(pool) - 1, len(pool))

    def signed_in(self, c: C) -> None:
        """`c` showed a valid token (or closed): it waits no more."""
        if self.every_waiting.pop(c, None) is None:
            return
        peer = self.seats[c].peer
        pool = self.waiting[peer]
        del pool[c]
        self.most.move(peer, len(pool) + 1, len(pool))
        if not pool:
            del self.waiting[peer]

    def close(self, c: C) -> None:
        if c not in self.seats:
            return
        self.signed_in(c)
        self._leave_job(c)
        peer = self.seats.pop(c).peer
        self.per_peer[peer] -= 1
        if self.per_peer[peer] <= 0:
            del self.per_peer[peer]

    def account(self, c: C, job: str) -> JobLoad | None:
        """`c` acts for `job` (its token's, or an admin request's): the job's load when `c` has
        just joined it (for `settle`), None when it counted for it already or is not counted here."""
        seat = self.seats.get(c)
        if seat is None or seat.job == job:
            return None
        self._leave_job(c)
        seat.job = job
        self.held[job] += 1
        self.idle.setdefault(job, {})
        self.lines.setdefault(job, {})
        return self._job_load(job)

    def busy(self, c: C, busy: bool) -> None:
        """`c` took a request (True) or answered it (False: idle, unless a rank's newest line)."""
        seat = self.seats.get(c)
        if seat is None:
            return
        seat.busy = busy
        if seat.job is not None:
            self.idle[seat.job].pop(c, None)  # re-entered at the end: least recently used first
            if not busy and seat.line is None:
                self.idle[seat.job][c] = None

    def line(self, c: C, rank: Rank | None) -> None:
        """`c` is now `rank`'s newest heartbeat line of its job (None: no line any more). The
        line it replaces, if idle, may close."""
        seat = self.seats.get(c)
        if seat is None or seat.job is None:
            return
        lines = self.lines[seat.job]
        if seat.line is not None and lines.get(seat.line) is c:
            del lines[seat.line]
        seat.line = rank
        if rank is None:
            return
        old = lines.get(rank)
        if old is not None and old is not c:
            self.seats[old].line = None
            if not self.seats[old].busy:
                self.idle[seat.job][old] = None
        lines[rank] = c
        self.idle[seat.job].pop(c, None)

    def is_line(self, c: C) -> bool:
        """Whether `c` is a rank's newest heartbeat line (True for one not counted here)."""
        seat = self.seats.get(c)
        return seat is None or seat.line is not None

    def load(self, peer: str, now: float, full: bool) -> Load:
        """The counts `admit` reads for a newcomer from `peer`; jobs listed only when `full`."""
        idle = tuple(self._job_load(j) for j, pool in self.idle.items() if pool) if full else ()
        most = self.most.first()
        oldest = next(iter(self.every_waiting.items()), None)
        return Load(
            len(self.seats),
            self.per_peer[peer],
            self._waiting(peer, now),
            self._waiting(most, now) if most is not None else None,
            self._waiting(self.seats[oldest[0]].peer, now) if oldest is not None else None,
            len(self.held),
            idle,
        )

    def oldest_waiting(self, peer: str) -> C:
        return next(iter(self.waiting[peer]))

    def oldest_idle(self, job: str) -> C:
        return next(iter(self.idle[job]))

    def _job_load(self, job: str) -> JobLoad:
        return JobLoad(job, self.held[job], len(self.lines[job]), len(self.idle[job]))

    def _waiting(self, peer: str, now: float) -> Waiting | None:
        pool = self.waiting.get(peer)
        if not pool:
            return None
        return Waiting(peer, len(pool), now - next(iter(pool.values())))

    def _leave_job(self, c: C) -> None:
        seat = self.seats[c]
        job = seat.job
        if job is None:
            return
        self.line(c, None)
        self.idle[job].pop(c, None)
        seat.job = None
        self.held[job] -= 1
        if self.held[job] <= 0:
            del self.held[job], self.idle[job], self.lines[job]
