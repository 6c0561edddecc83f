"""The quorum decision, as pure functions of a round's inputs (no locks, sockets or clocks).
`decide`: form now, with whom, or wait; `plan`: at which step, and who heals from whom;
`isolated`: is their silence my isolation. ftcore/lighthouse_job.py gathers the inputs
under the job's lock and acts on the answers."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Round:
    """What one formation attempt sees."""

    previous: frozenset[int] | None  # members of the last quorum formed (None: none yet)
    requesting: frozenset[int]  # healthy groups all of whose ranks are asking
    healthy: frozenset[int]  # groups healthy now and not on standby
    min_replicas: int
    expected: int  # groups the job starts with (its first quorum waits for them)
    waited: bool  # the round has waited the join timeout


def decide(r: Round) -> tuple[int, ...] | str:
    """The members to form a quorum of now (sorted), or why the round waits.

    Fast: every healthy member of the previous quorum asks (a failed member is not waited
    for), or, for a first quorum, every healthy group and at least `expected`. Otherwise the
    round waits up to the join timeout. Always: at least min_replicas groups and a majority
    of the healthy ones (no split brain)."""
    n = len(r.requesting)
    if not n:
        return "no healthy group is asking"
    if n < r.min_replicas:
        return f"{n} groups ask, the job needs {r.min_replicas}"
    if 2 * n <= len(r.healthy):
        return f"{n} of {len(r.healthy)} healthy groups ask: not a majority"
    if r.previous is not None:
        fast = (r.previous & r.healthy) <= r.requesting
    else:
        fast = r.healthy <= r.requesting and n >= r.expected
    if fast or r.waited:
        return tuple(sorted(r.requesting))
    return "waiting for healthy groups of the previous quorum" if r.previous is not None else "waiting for the job"


@dataclass(frozen=True)
class Member:
    """One member group's request in the round that forms."""

    group: int
    incarnation: int
    step: int  # the lowest step its ranks report
    last_quorum: int  # the lowest quorum id its ranks last trained in


@dataclass(frozen=True)
class Plan:
    max_step: int  # the step every member is at after this round's heals
    heal: dict[int, int]  # healing group -> the group it heals from


def plan(previous: frozenset[tuple[int, int]] | None, members: list[Member], finished_step: int) -> Plan | None:
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
    return Plan(max_step, {g: sources[i % len(sources)] for i, g in enumerate(healers)})


def isolated(silent: int, live: int) -> bool:
    """Whether the lighthouse should take `silent` of `live` groups going quiet (no heartbeat
    for half a timeout, no connection closed) as its own isolation rather than their failure:
    most of them at once. A group is then failed only on its own evidence: its connection closed,
    a peer's report, or its silence while the others speak."""
    return live >= 2 and 2 * silent > live


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
