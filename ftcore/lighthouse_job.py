"""One job on the lighthouse: its replica groups, their health, and its quorum rounds.

Each job has its own lock, so jobs served by one lighthouse never wait on each other. A group
is failed three ways: its heartbeat connection closes (a killed process: milliseconds), a
survivor reports a data-plane error and the group does not heartbeat within FAILURE_PROBE, or
its heartbeats stop for HEARTBEAT_TIMEOUT (a hang). A fast quorum forms as soon as every
healthy member of the previous quorum asks; otherwise a round waits up to JOIN_TIMEOUT.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ftcore import quorum as quorum_rule
from ftcore.messages import (
    Busy,
    FailureReport,
    HeartbeatReply,
    Identity,
    OvertakenReply,
    Pace,
    Quorum,
    QuorumRefused,
    QuorumRequest,
    RankInfo,
    StandbyReply,
)
from ftcore.pace import PaceJudge

if TYPE_CHECKING:
    from ftcore.lighthouse import Lighthouse

TICK_S = 0.01  # formation rounds: how often a waiting round re-checks its members
SWEEP_S = 0.05  # health sweeps over every rank (disconnects and reports act at once)


@dataclass
class RankRecord:
    """What the lighthouse knows of one rank."""

    rank: int
    store: str = ""  # host:port of this rank's TCPStore (rendezvous for cross-group groups)
    heal: str = ""  # host:port of this rank's heal server
    step: int = 0  # committed steps
    last_beat: float = 0.0
    disconnected: bool = False
    disconnected_at: float = 0.0
    beat_lines: int = 0  # open connections it heartbeats on: it died when the last one closed
    # its last quorum answer: (its step, quorum id, the reply) (_answered_again)
    answered: tuple[int, int, str] | None = None


@dataclass
class GroupRecord:
    """What the lighthouse knows of one incarnation of a replica group."""

    group: int
    incarnation: int
    world: int  # ranks per group (K)
    ranks: dict[int, RankRecord] = field(default_factory=dict)
    healthy: bool = False
    left: bool = False
    leaving: bool = False  # a rank said goodbye: the group is ending cleanly, rank by rank
    relay: bool = False  # its relay speaks for all its ranks as rank 0 (ftcore/relay.py)

    @property
    def speakers(self) -> int:
        """The ranks that speak to the lighthouse: all of them, or the relay alone."""
        return 1 if self.relay else self.world

    @property
    def step(self) -> int:
        return min((r.step for r in self.ranks.values()), default=0)

    def lost_rank(self, now: float, probe: float, heartbeat_timeout: float | None) -> int | None:
        """A rank this incarnation has lost for good (connection closed for longer than a
        reconnect takes, or silent past the heartbeat timeout, None: silence does not count):
        the group must restart."""
        for rk in self.ranks.values():
            if (rk.disconnected and now - rk.disconnected_at > probe) or (
                heartbeat_timeout is not None and now - rk.last_beat > heartbeat_timeout
            ):
                return rk.rank
        return None


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
    last_identity: Identity
    deliver: Deliver
    deadline: float = math.inf  # monotonic: past it the request is answered with a timeout
    busy: Busy | None = None  # its last step's compute (ftcore/pace.py)
    idle: int = -1  # the quorum id of its last step if nobody had work in it (only absent groups' is left)
    leased: bool = False  # sent after its step had gone on without this lighthouse: its sender ignores the reply


class StaleIncarnation(Exception):
    """A message from a process of a group incarnation that has been replaced."""


class Job:
    """One training job's membership and quorum: groups, pending quorum requests, heals.

    Each job has its own lock, so jobs served by one lighthouse never wait on each other."""

    def __init__(self, lh: Lighthouse, name: str, num_groups: int, min_replicas: int):
        self.lh, self.cfg, self.name = lh, lh.cfg, name
        self.num_groups = num_groups  # 0: not declared by the ranks (any group id up to MAX_GROUPS)
        self.min_replicas = max(lh.cfg.min_replicas, min_replicas)
        self.expected = num_groups or lh.cfg.expected_replicas
        self.lock = threading.Lock()
        self.groups: dict[int, GroupRecord] = {}
        self.quorum: Quorum | None = None  # the last one formed (its shared part: no rank's addresses)
        self.quorum_id = 0
        self.max_step = 0
        self.pending: dict[int, dict[int, Request]] = {}
        self.complete: set[int] = set()  # groups all of whose ranks are pending: formation looks at these
        self.round_start: float | None = None  # arrival of this round's first pending request
        self.next_deadline = math.inf  # the earliest deadline among pending requests
        self.finished_step = 0  # the highest step a group that finished (left) reached
        self._last_wait_event = 0.0
        self._last_sweep = 0.0
        self.failed: list[int] = []  # members of the current quorum that are not healthy (for heartbeats)
        self.healthy: set[int] = set()  # groups healthy at the last sweep (kept with GroupRecord.healthy)
        self.force_new = False  # a data-plane failure: the next quorum gets a new id, whoever is in it
        self.reports: dict[int, float] = {}  # quorum_id -> time of the first data-plane failure report
        self.pace = PaceJudge(lh.cfg.pace)
        self.excluded: dict[int, float] = {}  # fail-slow: group -> monotonic end of its standby
        self.events: collections.deque = collections.deque(maxlen=lh.cfg.events_per_job)
        self.last_heard = time.monotonic()  # the last message of any of its ranks
        self.isolated = False  # most groups went silent at once: this lighthouse is likely cut off
        self.grace_until = 0.0  # after an isolation: silence is not judged before this
        self.relay: bool | None = None  # its groups speak through relays (ftcore/relay.py); None: no group yet
        self.need = 1  # complete groups before an arrival tries to form the round (_count_need)

    def event(self, kind: str, **data: Any) -> None:
        self.lh.event(kind, job=self.name, **data)

    # ---- membership ---------------------------------------------------------------
    def _rank(self, info: RankInfo) -> tuple[GroupRecord, RankRecord]:
        """Find or register the sender of `info` (checked by RankInfo.parse).

        Everything is checked before anything changes: a bad message is a 400, never state."""
        g, world, r, inc, step = info.group, info.world, info.rank, info.incarnation, info.step
        if self.num_groups and g >= self.num_groups:
            raise ValueError(f"group={g} is outside [0, {self.num_groups})")
        grp = self.groups.get(g)
        if grp is not None and inc < grp.incarnation:
            raise StaleIncarnation(f"group {g} incarnation {inc} was replaced by {grp.incarnation}")
        if grp is not None and inc == grp.incarnation and world != grp.world:
            raise ValueError(f"group {g} incarnation {inc} has {grp.world} ranks, this rank says {world}")
        if self.relay is not None and self.relay != info.relay:
            # a quorum's replies hand rank k the addresses of rank k: one layout per job
            raise ValueError(f"job {self.name}: some groups speak through a relay and some do not (FTCORE_RELAY)")
        if not self.num_groups and info.num_groups:  # a job first seen without its size learns it
            self.num_groups = info.num_groups
            self.expected = self.expected or self.num_groups
        if grp is None or inc > grp.incarnation:
            if grp is not None:
                self._drop_pending(g)
            grp = self.groups[g] = GroupRecord(g, inc, world, relay=info.relay)
            self.relay = info.relay
            self.healthy.discard(g)  # a new incarnation is healthy once the sweep says so
            relayed = {"relay": True} if info.relay else {}
            self.event("register", group=g, incarnation=inc, world=world, step=step, **relayed)
        rk = grp.ranks.get(r)
        if rk is None:
            rk = grp.ranks[r] = RankRecord(r)
        grp.left = False
        rk.store, rk.heal = info.store or rk.store, info.heal or rk.heal
        rk.step = max(rk.step, step)  # a late heartbeat may carry an older step
        rk.last_beat = self.last_heard = time.monotonic()
        if rk.disconnected:
            rk.disconnected = False
            self._last_sweep = 0.0
        self.max_step = max(self.max_step, rk.step)
        # After a lighthouse restart, quorum ids resume above any a member has seen.
        self.quorum_id = max(self.quorum_id, info.quorum_id)
        return grp, rk

    def _drop_pending(self, g: int) -> None:
        for req in self._pop(g).values():
            req.deliver(QuorumRefused("stale", "stale incarnation"))

    def _is_healthy(self, grp: GroupRecord, now: float) -> bool:
        if grp.left or len(grp.ranks) < grp.speakers:
            return False
        report = self.reports.get(self.quorum.quorum_id) if self.quorum else None
        in_quorum = self.quorum is not None and grp.group in self.quorum.groups
        silence_counts = self._silence_counts(now)
        for rk in grp.ranks.values():
            if rk.disconnected or (silence_counts and now - rk.last_beat > self.cfg.heartbeat_timeout):
                return False
            if report is not None and in_quorum and rk.last_beat < report and now > report + self.cfg.failure_probe:
                return False
        return True

    def _silence_counts(self, now: float) -> bool:
        """Whether a rank's silence is evidence against it: not while this lighthouse was paused
        or seems cut off, nor for a heartbeat timeout after (it heard nobody: not their fault)."""
        return not (self.lh.in_grace(now) or self.isolated or now < self.grace_until)

    def _notice_isolation(self, now: float) -> None:
        """Most groups silent at once, none of them gone: the one cut off is most likely this
        lighthouse (ftcore/quorum.py, `isolated`). It holds its verdicts while that lasts, and
        grants everyone a heartbeat timeout to be heard once it ends."""
        live = [g for g in self.groups.values() if not g.left and len(g.ranks) == g.speakers]
        # Quiet for half a timeout already counts: groups cut off together fall silent within a
        # heartbeat interval of each other, and the first must not be judged before the rest.
        quiet = self.cfg.heartbeat_timeout / 2
        silent = sum(
            1
            for g in live
            if not any(r.disconnected for r in g.ranks.values())
            and now - max(r.last_beat for r in g.ranks.values()) > quiet
        )
        isolated = quorum_rule.isolated(silent, len(live))
        if isolated != self.isolated:
            self.isolated = isolated
            if isolated:
                self.event("lighthouse_isolated", silent=silent, groups=len(live))
            else:
                self.grace_until = now + self.cfg.heartbeat_timeout
                self.event("lighthouse_reconnected", grace_s=self.cfg.heartbeat_timeout)

    def _update_health(self, now: float) -> None:
        """O(ranks): run every SWEEP_S, and at once after a disconnect or a failure report."""
        self.lh.notice_pause(now)
        self._last_sweep = now
        self._notice_isolation(now)
        for grp in self.groups.values():
            ok = self._is_healthy(grp, now)
            if ok != grp.healthy:
                grp.healthy = ok
                (self.healthy.add if ok else self.healthy.discard)(grp.group)
                if ok:
                    self.event("group_healthy", group=grp.group, incarnation=grp.incarnation, step=grp.step)
                elif not (grp.left or grp.leaving):
                    why = (
                        "connection closed" if any(r.disconnected for r in grp.ranks.values()) else "heartbeat timeout"
                    )
                    self.event("failure_detected", group=grp.group, incarnation=grp.incarnation, reason=why)
        self.failed = [
            g for g in (self.quorum.groups if self.quorum else ()) if g in self.groups and not self.groups[g].healthy
        ]
        self._count_need()

    def _count_need(self) -> None:
        """The complete groups a round needs before an arrival tries to form it (a majority, and
        the fast path's members: quorum.decide); the ticker tries the rest every TICK_S. One
        attempt per round at arrivals, not one per arrival: O(groups), not O(groups^2)."""
        healthy = self.healthy - self.excluded.keys()
        fast = len(healthy & set(self.quorum.groups)) if self.quorum else max(len(healthy), self.expected)
        self.need = max(fast, len(healthy) // 2 + 1, self.min_replicas)

    # ---- quorum ---------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if now - self._last_sweep >= SWEEP_S:
            self._update_health(now)
        if self.pending and self._worth_trying(now):
            self._maybe_form(now)
        if now >= self.next_deadline:
            self._expire(now)

    def _worth_trying(self, now: float) -> bool:
        """Whether a tick's formation attempt can do anything an arrival's did not: enough groups
        complete, the join timeout reached, or a pending group unhealthy (lost: told to exit)."""
        waited = self.round_start is not None and now - self.round_start >= self.cfg.join_timeout
        return len(self.complete) >= self.need or waited or not self.pending.keys() <= self.healthy

    def _expire(self, now: float) -> None:
        """Answer the requests whose deadline passed (O(pending), only when one has)."""
        for g in list(self.pending):
            for r, req in list(self.pending[g].items()):
                if now >= req.deadline:
                    del self.pending[g][r]
                    self.complete.discard(g)
                    req.deliver(QuorumRefused("timeout", "timeout waiting for a quorum"))
            if not self.pending[g]:
                del self.pending[g]
        self._restart_round()

    def _drop_overtaken(self, now: float) -> None:
        """A leased request (sent after its step had gone on without this lighthouse, which
        happens as a pause ends) is for a round its group finishes on its own. Once a peer asks
        for a later step, forming it with that peer would heal the group "up" to a step it
        reaches anyway and leave the peer waiting for a request the group never sends: it
        leaves the round, and the group asks again at the step it is really at. Just after this
        lighthouse heard nobody (a pause, a partition), a request of a member of the unchanged
        quorum that is behind its peers is taken as such a request too: sent before its group
        went on under the lease, it arrives late (TCP retransmits each connection on its own
        backoff), and a member that really fell behind heals once the grace is over."""
        if len(self.pending) < 2:
            return
        top = max(r.step for rs in self.pending.values() for r in rs.values())
        members = set(self.quorum.identity) if self.quorum is not None and not self._silence_counts(now) else set()
        for g, rs in list(self.pending.items()):
            late = all(r.step < top and (r.leased or (g, r.incarnation) in members) for r in rs.values())
            if late:
                for req in self._pop(g).values():
                    req.deliver(OvertakenReply(top))

    def _maybe_form(self, now: float) -> None:
        """O(groups): one formation attempt on the health of the last sweep."""
        self._drop_overtaken(now)
        for g in list(self.pending.keys() - self.healthy):
            # The survivors of a group that lost a rank cannot train without it: tell them to
            # exit now (their torchrun or launcher restarts the group) instead of letting them
            # wait out a quorum timeout.
            lost = self.groups[g].lost_rank(
                now, self.cfg.failure_probe, self.cfg.heartbeat_timeout if self._silence_counts(now) else None
            )
            if lost is not None:
                for req in self._pop(g).values():
                    req.deliver(QuorumRefused("lost", f"replica group {g} lost rank {lost}; restart the group"))
        if not self.pending:
            return
        # a group on standby is not waited for, nor counted
        healthy = frozenset(self.healthy - self.excluded.keys())
        round_start = self.round_start if self.round_start is not None else now
        decision = quorum_rule.decide(
            quorum_rule.Round(
                previous=frozenset(self.quorum.groups) if self.quorum else None,
                requesting=frozenset(self.complete & healthy),
                healthy=healthy,
                min_replicas=self.min_replicas,
                expected=self.expected,
                # a round does not time out on members this lighthouse cannot hear (isolated, paused)
                waited=now - round_start >= self.cfg.join_timeout and self._silence_counts(now),
            )
        )
        if isinstance(decision, tuple):
            self._form(list(decision))
        elif now - round_start > 1.0 and now - self._last_wait_event > 1.0:
            self._last_wait_event = now  # say why a round is stuck (status page, timeline)
            self.event(
                "quorum_waiting",
                reason=decision,
                requesting=sorted(self.complete & healthy),
                healthy=sorted(healthy),
                pending={str(g): sorted(r) for g, r in self.pending.items()},
                previous=list(self.quorum.groups) if self.quorum else None,
                seconds=round(now - round_start, 2),
            )

    def _resumed(self, members: list[int], identity: Identity) -> tuple[int, str] | None:
        """After a restart of this lighthouse: the (quorum id, lighthouse id) its members all
        last trained in, when that quorum had exactly this membership. Resuming it keeps their
        process groups (and a group that went on without this lighthouse, on its lease, in step)."""
        reqs = [r for g in members for r in self.pending[g].values()]
        first = reqs[0]
        if (
            first.last_lighthouse_id
            and first.last_identity == identity
            and all(
                (r.last_quorum, r.last_lighthouse_id, r.last_identity)
                == (first.last_quorum, first.last_lighthouse_id, identity)
                for r in reqs
            )
        ):
            return first.last_quorum, first.last_lighthouse_id
        return None

    def _form(self, members: list[int]) -> None:
        """Build the whole quorum and every rank's reply first, then change state."""
        identity = tuple((g, self.groups[g].incarnation) for g in members)
        resumed = self._resumed(members, identity) if self.quorum is None and not self.force_new else None
        new_id = self.quorum is None or self.quorum.identity != identity or self.force_new
        quorum_id = self.quorum_id + 1 if new_id else self.quorum_id
        lighthouse_id = self.quorum.lighthouse_id if self.quorum is not None and not new_id else self.lh.lighthouse_id
        if resumed is not None:
            quorum_id, lighthouse_id = resumed
        busy = self._busy(members)
        idle = self.quorum is not None and all(
            r.idle == self.quorum.quorum_id for g in members for r in self.pending[g].values()
        )
        where = quorum_rule.plan(
            frozenset(self.quorum.identity) if self.quorum is not None else None,
            [
                quorum_rule.Member(
                    g,
                    self.groups[g].incarnation,
                    min(req.step for req in self.pending[g].values()),
                    min(req.last_quorum for req in self.pending[g].values()),
                )
                for g in members
            ],
            self.finished_step,
        )
        if where is None:
            # Training ended (a group finished at a later step and left) and nobody here holds
            # that state: these groups must not start a history of their own from an older one.
            for g in members:
                for req in self._pop(g).values():
                    req.deliver(
                        QuorumRefused("finished", f"the job finished at step {self.finished_step}; nothing to rejoin")
                    )
            return
        max_step = where.max_step
        q = Quorum(
            quorum_id=quorum_id,
            lighthouse_id=lighthouse_id,
            job=self.name,
            identity=identity,
            groups=tuple(members),
            max_step=max_step,
            heal=where.heal,
            lease_s=self.cfg.lease,
            # the members' compute in the step they just finished: each sees its wait for the slowest
            pace=Pace(self.quorum.quorum_id, round(max(busy.values()), 6), round(sum(busy.values()) / len(busy), 6))
            if busy and self.quorum
            else None,
        )
        replies = self._replies(q)
        changed = self.quorum is None or self.quorum.key != q.key
        self.quorum, self.quorum_id, self.force_new = q, quorum_id, False
        self.max_step = max(self.max_step, max_step)
        self.failed = []
        self._count_need()
        for g in members:
            del self.pending[g]
        self.complete -= set(members)
        self._restart_round()
        for req, reply in replies:
            req.deliver(reply)
        if changed:
            self.event("quorum_formed", quorum_id=quorum_id, groups=members, max_step=max_step, heal=q.shared()["heal"])
        for g in where.heal:
            self.event("heal_assigned", group=g, source=q.heal[g], step=max_step, quorum_id=quorum_id)
        if idle and self.excluded:  # the work left is the excluded groups' own: let them do it
            self.excluded = dict.fromkeys(self.excluded, 0.0)
        self._judge_pace(busy, members)

    def _replies(self, q: Quorum) -> list[tuple[Request, str]]:
        """Every member rank's reply. Each rank k gets only the two addresses it uses: rank k of
        the first member hosts the rendezvous of every rank k, and a healing rank k fetches
        from rank k of its source. The part every rank shares is encoded once per round, and each
        distinct reply once (every rank k that heals from nobody gets the same)."""
        leader = self.groups[q.groups[0]].ranks
        shared = q.shared_json()
        replies = []
        made: dict[tuple[str, str], str] = {}
        for g in q.groups:
            src = self.groups[q.heal[g]].ranks if g in q.heal else None
            for req in self.pending[g].values():
                store = leader[req.rank].store if req.rank in leader else ""
                heal_from = src[req.rank].heal if src and req.rank in src else ""
                reply = made.get((store, heal_from))
                if reply is None:
                    reply = made[store, heal_from] = Quorum.for_rank(shared, store, heal_from)
                replies.append((req, reply))
                if req.rank in self.groups[g].ranks:
                    self.groups[g].ranks[req.rank].answered = (req.step, q.quorum_id, reply)
        return replies

    def _answered_again(self, rk: RankRecord, ask: QuorumRequest) -> str | None:
        """The answer a rank was given for this step in the current quorum, when it says it did
        not apply it (`again`: lost with its connection, or its round given up) and nothing
        failed since: the quorum that counts it stands, and its peers wait for it there."""
        a = rk.answered
        if not ask.again or a is None or self.quorum is None or self.force_new:
            return None
        return a[2] if (ask.info.step, self.quorum.quorum_id) == a[:2] else None

    # ---- fail-slow --------------------------------------------------------------------
    def _busy(self, members: list[int]) -> dict[int, float]:
        """Each member's compute in the step it just finished in the current quorum (its slowest
        rank's), for members that all ran that step in it and nobody healed: comparable figures.
        The judge records them with each rank's (a relay sends them all with its group's)."""
        if self.quorum is None or self.quorum.heal:
            return {}
        qid, out, ranks = self.quorum.quorum_id, {}, {}
        for g in members:
            reqs = self.pending[g].values()
            figures = {r.rank: r.busy.seconds for r in reqs if r.busy is not None and r.busy.quorum_id == qid}
            if figures and len(figures) == len(reqs):
                out[g] = max(figures.values())
                first = next(iter(reqs)).busy
                relayed = first.ranks if first is not None and self.groups[g].relay else ()
                if len(relayed) == self.groups[g].world:  # a relay sends every rank's figure
                    figures = dict(enumerate(relayed))
                ranks[g] = figures if len(figures) == self.groups[g].world else {}
        if len(out) < len(members):
            return {}
        self.pace.observe(out, ranks)
        return out

    def _judge_pace(self, busy: dict[int, float], members: list[int]) -> None:
        """Exclude the member the judge finds slow (its figures were recorded by `_busy`)."""
        v = self.pace.judge(
            members, {g: self.groups[g].incarnation for g in members}, self.min_replicas, len(self.excluded)
        )
        if v is None:
            return
        self.excluded[v.group] = time.monotonic() + v.probation_s
        self.event(
            "group_excluded",
            group=v.group,
            incarnation=self.groups[v.group].incarnation,
            reason=f"{v.ratio}x its peers' compute over {self.cfg.pace.window} rounds, bound {v.bound}x",
            ratio=v.ratio,
            bound=v.bound,
            busy_s=v.busy_s,
            peers_busy_s=v.peers_s,
            window=self.cfg.pace.window,
            probation_s=v.probation_s,
            rank=v.rank,  # None: one figure for the group (relayed) or its ranks alike
            rank_busy_s=v.rank_busy_s,
            other_ranks_busy_s=v.others_busy_s,
        )

    def _standby(self, grp: GroupRecord, now: float) -> StandbyReply | None:
        """The answer to a quorum request of an excluded group while its probation lasts."""
        until = self.excluded.get(grp.group)
        if until is None:
            return None
        if now < until and not self.finished_step:  # once the job ends there is nothing to wait for
            return StandbyReply(
                round(min(until - now, 1.0), 3), f"excluded as slower than its peers for {until - now:.1f}s more"
            )
        del self.excluded[grp.group]
        self.pace.readmit(grp.group)
        self.event("group_readmitted", group=grp.group, incarnation=grp.incarnation)
        return None

    def enqueue(self, ask: QuorumRequest, deliver: Deliver, timeout: float) -> Request:
        """A rank's quorum request joins this round; `deliver` gets the reply when it forms
        (maybe at once: this arrival may complete the round; the ticker does the rest), or a
        timeout error after `timeout` seconds."""
        with self.lock:
            grp, _ = self._rank(ask.info)
            now = time.monotonic()
            req = Request(
                grp.group,
                ask.info.rank,
                grp.incarnation,
                ask.info.step,
                now,
                ask.info.quorum_id,
                ask.quorum_lighthouse_id,
                ask.quorum_identity,
                deliver,
                now + timeout,
                ask.busy,
                ask.idle,
                ask.leased,
            )
            standby = self._standby(grp, now)
            if standby is not None:
                deliver(standby)
                return req
            again = self._answered_again(grp.ranks[req.rank], ask)
            if again is not None:
                deliver(again)
                return req
            self.next_deadline = min(self.next_deadline, req.deadline)
            reqs = self.pending.setdefault(grp.group, {})
            old = reqs.get(req.rank)
            if old is not None:  # the same rank asking again (a retry): the earlier waiter is gone
                old.deliver(QuorumRefused("superseded", "superseded by a newer request"))
            reqs[req.rank] = req
            if self.round_start is None:
                self.round_start = now
            if len(reqs) == grp.speakers:  # O(groups) formation only when a group is complete
                self.complete.add(grp.group)
                if not grp.healthy:
                    self._update_health(now)  # a new or returning group need not wait for the sweep
                if len(self.complete) >= self.need:
                    self._maybe_form(now)
            return req

    def withdraw(self, req: Request) -> None:
        """A request whose waiter gave up (timeout) leaves the round."""
        with self.lock:
            reqs = self.pending.get(req.group, {})
            if reqs.get(req.rank) is req:
                del reqs[req.rank]
                self.complete.discard(req.group)
                if not reqs:
                    del self.pending[req.group]
                self._restart_round()

    def _pop(self, g: int) -> dict[int, Request]:
        reqs = self.pending.pop(g, {})
        self.complete.discard(g)
        self._restart_round()
        return reqs

    def _restart_round(self) -> None:
        """O(pending): after requests leave the round (formation, timeouts, failures)."""
        reqs = [r for rs in self.pending.values() for r in rs.values()]
        self.round_start = min((r.t for r in reqs), default=None)
        self.next_deadline = min((r.deadline for r in reqs), default=math.inf)

    # ---- other requests -------------------------------------------------------------
    def heartbeat(self, info: RankInfo, new_line: bool = False) -> HeartbeatReply:
        """O(1): the failed list is the last sweep's. `new_line`: the first heartbeat on its
        connection (a rank may open another while one stalls, lighthouse_client.py)."""
        with self.lock:
            _, rk = self._rank(info)
            rk.beat_lines += new_line
            return HeartbeatReply(self.quorum.quorum_id if self.quorum else 0, tuple(self.failed))

    def disconnected(self, g: int, r: int, inc: int) -> None:
        """One of the rank's heartbeat connections closed: it is gone once none is left."""
        with self.lock:
            grp = self.groups.get(g)
            if grp is not None and grp.incarnation == inc and r in grp.ranks and not grp.left:
                rk = grp.ranks[r]
                rk.beat_lines = max(rk.beat_lines - 1, 0)
                if rk.beat_lines:
                    return
                rk.disconnected, rk.disconnected_at = True, time.monotonic()
                self._update_health(time.monotonic())
                if self.pending:
                    self._maybe_form(time.monotonic())

    def report_failure(self, report: FailureReport) -> None:
        with self.lock:
            qid = report.quorum_id
            self.event("failure_reported", group=report.group, rank=report.rank, quorum_id=qid, error=report.error)
            self.reports.setdefault(qid, time.monotonic())
            if self.quorum is not None and qid == self.quorum.quorum_id:
                self.force_new = True  # the reporter's process group is broken: rebuild everyone's
            self._last_sweep = 0.0  # probe at the next tick

    def leave(self, info: RankInfo) -> None:
        with self.lock:
            grp = self.groups.get(info.group)
            if grp is None or grp.incarnation != info.incarnation:
                return
            rank = grp.ranks.pop(info.rank, None)
            if rank is not None:
                self.finished_step = max(self.finished_step, rank.step)
            grp.leaving = True  # its other ranks leave next: not a failure
            if not grp.ranks and not grp.left:
                grp.left = True
                grp.healthy = False
                self.healthy.discard(grp.group)
                self.event("group_left", group=grp.group, incarnation=grp.incarnation)

    # ---- lifetime -----------------------------------------------------------------------
    def retirement(self, now: float, idle_s: float) -> str | None:
        """Why this job may be retired now ("finished", "idle"), or None. Under the job's lock."""
        if self.pending or not self._silence_counts(now):
            return None
        quiet = now - self.last_heard
        groups = self.groups.values()
        if groups and all(g.left for g in groups):
            return "finished"
        # a group left cleanly and the rest are dead: finished once nobody speaks any more
        if any(g.left for g in groups) and all(g.left or not g.healthy for g in groups):
            return "finished" if quiet > self.cfg.failure_probe else None
        if quiet > idle_s:
            return "idle"
        return None

    def summary(self, now: float) -> dict[str, Any]:
        """One line of GET /jobs. Under the job's lock."""
        return {
            "job": self.name,
            "groups": len(self.groups),
            "healthy": len(self.healthy),
            "ranks": sum(g.world if g.relay else len(g.ranks) for g in self.groups.values()),
            "quorum_id": self.quorum.quorum_id if self.quorum else 0,
            "max_step": self.max_step,
            "finished_step": self.finished_step,
            "idle_s": round(now - self.last_heard, 3),
        }

    def status(self) -> dict[str, Any]:
        with self.lock:
            return self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        """GET /status's view of this job (under the job's lock)."""
        now = time.monotonic()
        return {
            "job": self.name,
            "min_replicas": self.min_replicas,
            "max_step": self.max_step,
            "quorum": self.quorum.shared() if self.quorum else None,
            "groups": [
                {
                    "group": g.group,
                    "incarnation": g.incarnation,
                    "healthy": g.healthy,
                    "left": g.left,
                    "step": g.step,
                    "ranks": g.world if g.relay and g.ranks else len(g.ranks),
                    "world": g.world,
                    "relay": g.relay,
                    "standby_s": (
                        round(max(self.excluded[g.group] - now, 0.0), 2) if g.group in self.excluded else None
                    ),
                    "last_beat_age_s": max((now - r.last_beat for r in g.ranks.values()), default=None),
                }
                for g in sorted(self.groups.values(), key=lambda g: g.group)
            ],
        }
