"""The quorum decision, as pure functions of a round's inputs (no locks, sockets or clocks).
`decide`: form now, with whom, or wait; `plan`: at which step, and who heals from whom;
`isolated`: is their silence my isolation. ftcore/lighthouse_job.py gathers the inputs
under the job's lock and acts on the answers."""

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class FormationRound:
    """What one formation attempt sees."""

    previous: frozenset[int] | None  # members of the last quorum formed (None: none yet)
    requesting: frozenset[int]  # healthy groups all of whose ranks are asking
    healthy: frozenset[int]  # groups healthy now and not on standby
    min_replicas: int
    expected: int  # groups the job starts with (its first quorum waits for them)
    waited: bool  # the round has waited the join timeout
    # members of the previous quorum that may still train in it on its lease (not known crashed)
    leasing: frozenset[int] = frozenset()
    # no quorum formed here yet (a restarted lighthouse), and the requesters are exactly the
    # members of the one quorum they all last trained in: nobody of it trains on elsewhere
    resumes: bool = False


@dataclass(frozen=True)
class Formed:
    members: tuple[int, ...]  # sorted


@dataclass(frozen=True)
class Wait:
    reason: str  # for the quorum_waiting event


def majority(healthy: int) -> int:
    """The fewest groups that are a majority of `healthy` ones: no two quorums can both have it."""
    return healthy // 2 + 1


def arrivals_needed(previous: frozenset[int] | None, healthy: frozenset[int], expected: int, min_replicas: int) -> int:
    """The complete groups a round needs before an arrival tries `decide`: the fast path's
    members (the healthy ones of the previous quorum, or for a first quorum every healthy group
    and at least `expected`), a majority and min_replicas. Fewer can only wait, so arrivals below
    it try nothing (O(groups) a round, not a decision per arrival); the ticker tries the rest."""
    fast = len(healthy & previous) if previous is not None else max(len(healthy), expected)
    return max(fast, majority(len(healthy)), min_replicas)


def decide(r: FormationRound) -> Formed | Wait:
    """The members to form a quorum of now, or why the round waits.

    Fast: every healthy member of the previous quorum asks (a failed member is not waited
    for), or, for a first quorum, every healthy group and at least `expected`, or every
    member of the quorum the requesters resume (a group on standby when this lighthouse
    restarted is not waited for: it was not in that quorum). Otherwise the
    round waits up to the join timeout. Always: at least min_replicas groups and a majority
    of the healthy ones (no split brain); and while the previous quorum's lease may run, a
    member of it (its members commit only together, so one of them here means none commits
    there): a quorum of others alone waits out the lease."""
    n = len(r.requesting)
    if not n:
        return Wait("no healthy group is asking")
    if n < r.min_replicas:
        return Wait(f"{n} groups ask, the job needs {r.min_replicas}")
    if n < majority(len(r.healthy)):
        return Wait(f"{n} of {len(r.healthy)} healthy groups ask: not a majority")
    if r.leasing and not r.leasing & r.requesting:
        return Wait(f"groups {sorted(r.leasing)} may still train on the last quorum's lease")
    if r.previous is not None:
        fast = (r.previous & r.healthy) <= r.requesting
    else:
        fast = (r.healthy <= r.requesting and n >= r.expected) or r.resumes
    if fast or r.waited:
        return Formed(tuple(sorted(r.requesting)))
    if r.previous is not None:
        return Wait("waiting for healthy groups of the previous quorum")
    return Wait("waiting for the job")


def waited_for(
    groups: tuple[int, ...], heal: dict[int, int], quorum_id: int, max_step: int, asked: Iterable[tuple[int, int, int]]
) -> frozenset[int]:
    """The members of the last quorum (`groups`, its `heal`s, id and step) that the next round
    waits for: all of them, but its healers when it never ran. It never ran when a member that
    trained before it asks for a later step without having applied it (`asked`: the last quorum
    id and step of each request of its other members): it went on under the previous quorum's
    lease, past this one's step, so nobody served the state the healers wait for."""
    trained = frozenset(groups) - heal.keys()
    never_ran = any(last < quorum_id and step > max_step for g, last, step in asked if g in trained)
    return trained if heal and never_ran else frozenset(groups)


@dataclass(frozen=True)
class Member:
    """One member group's request in the round that forms."""

    group: int
    incarnation: int
    step: int  # the lowest step its ranks report
    last_quorum: int  # the lowest quorum id its ranks last trained in


@dataclass(frozen=True)
class HealPlan:
    max_step: int  # the step every member is at after this round's heals
    heal: dict[int, int]  # healing group -> the group it heals from


def plan(previous: frozenset[tuple[int, int]] | None, members: list[Member], finished_step: int) -> HealPlan | None:
    """Where the members meet; None when the job already finished beyond anything they hold.

    Only members of the previous quorum (same incarnation) may serve state: a group that was
    left out may have committed a step the others discarded, so it heals even at an equal
    step. With no previous quorum (a restarted lighthouse) the latest reported quorum is
    trusted. Healers are spread over the sources in turn."""
    if previous is not None:
        trusted = [m for m in members if (m.group, m.incarnation) in previous]
    else:
        newest = max(m.last_quorum for m in members)
        trusted = [m for m in members if m.last_quorum == newest]
    trusted = trusted or members
    max_step = max(m.step for m in trusted)
    if finished_step > max_step:
        return None
    sources = [m.group for m in trusted if m.step == max_step]
    serving = set(sources)
    healers = [m.group for m in members if m.group not in serving]
    return HealPlan(max_step, {g: sources[i % len(sources)] for i, g in enumerate(healers)})


def resumed(last: Iterable[tuple[int, str, str, bool]], key: str) -> tuple[int, str, bool] | None:
    """After a restart of the lighthouse: the (quorum id, lighthouse id, settled) that every rank
    of a round's members last trained in, as `last` reports it (quorum id, lighthouse id,
    members' key, settled), when that quorum had exactly these members (`key`). Forming them
    resumes it: their process groups stand (and a group that went on without the lighthouse,
    on its lease, is in step). None otherwise, at the first rank that says so (a job's first
    quorum: at once)."""
    first = None
    for x in last:
        first = first or x
        if not x[1] or x != first or x[2] != key:
            return None
    return (first[0], first[1], first[3]) if first is not None else None


@dataclass(frozen=True)
class Hearing:
    """What the lighthouse heard of a job's groups over one interval."""

    live: int  # groups it expects to hear: complete, not left, not already failed
    silent: int  # of them, not heard over the interval (no connection closed: a silence, not a crash)
    accused: bool  # a group it did hear over the interval reports them (a stalled exchange or round)


def isolated(h: Hearing) -> bool:
    """Whether the lighthouse should take the silence of most of a job's groups at once as its
    own isolation rather than their failure. Only when nobody it still hears accuses them: a
    lighthouse that hears a group is not cut off from it, and that group's report that the
    silent ones stall it is evidence against them, however many they are (a rack switch, a
    storage stall, a bad driver push hangs several at once). Isolated, it holds its verdicts;
    a group is then failed only on its own evidence: its connection closed, or its silence
    while the others speak."""
    return h.live >= 2 and 2 * h.silent > h.live and not h.accused


def heartbeat_pace(speakers: int, budget: float, heartbeat_timeout: float) -> float:
    """Seconds between one speaker's heartbeats that keep `speakers` of them within `budget`
    beats/s of this lighthouse, at most a quarter of the heartbeat timeout (four beats to judge
    a silence by); 0 while the budget covers every speaker's own pace (at most 20/s each)."""
    pace = speakers / budget if budget > 0 else 0.0
    return 0.0 if pace <= 0.05 else round(min(pace, heartbeat_timeout / 4), 3)


def probe_window(failure_probe: float, pace: float) -> float:
    """How long after a failure report a member must be heard from to count as alive: the
    probe, or one beat at `pace` and half the probe when beats are slower than half of it."""
    return max(failure_probe, pace + failure_probe / 2)
