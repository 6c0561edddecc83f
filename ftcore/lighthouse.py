"""The lighthouse: FT-HSDP's control plane (membership, quorum, heal assignments, events).

Every rank of every replica group registers, heartbeats, and asks for a quorum once
per step. A quorum round answers all ranks of all participating groups at once with
the same `quorum_id` (it grows whenever the set of participating group incarnations
changes), the highest committed step, and which groups must heal from which up-to-date
group. Every message has one typed definition in ftcore/messages.py. A failed group is noticed three ways:

- its heartbeat connection closes (a killed process: milliseconds),
- a survivor reports a data-plane error and the group does not heartbeat within
  FAILURE_PROBE (a crash the kernel did not announce),
- its heartbeats stop for HEARTBEAT_TIMEOUT (a hang, SIGSTOP).

A fast quorum forms as soon as every healthy member of the previous quorum asks (a
failed member is not waited for; a new group joins at the next round); otherwise the
round waits up to JOIN_TIMEOUT for stragglers. Every quorum needs min_replicas groups
and a majority of the healthy groups (no split brain). HTTP/1.1 + JSON on one asyncio loop
(stdlib); every request needs the shared token in its Authorization header. The lighthouse
keeps no state that matters across its own restart: groups re-register on their next
heartbeat, their steps come with them, and the quorum they all report is handed out again
(same quorum id and lighthouse id: nobody rebuilds a process group), else a new id above any
reported.
A lighthouse that was paused grants a grace period before it judges anyone's silence, and
tells each quorum's members how long they may go on without it (the lease, manager.py).

Cost grows linearly with ranks: a heartbeat is O(1) (the failed list comes from the last
health sweep, every SWEEP_S), formation runs when a group's last rank arrives, over the
complete groups, and a round's shared reply is encoded once (BENCHMARKS.md, "Lighthouse at
scale").

    ftcore-lighthouse --bind HOST:PORT --token-file TOKEN [--min-replicas N]

One lighthouse serves several jobs at once: every message names its job (FTCORE_JOB_ID),
and each job has its own groups, quorum ids and lock. `GET /status?job=ID` is one job's.
Every field a client sends is checked at the door (ids within the job, 0 <= rank < world,
bounded integers): a bad request is a 400 and changes nothing.
"""

import argparse
import asyncio
import collections
import html
import json
import math
import secrets
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftcore import auth, netaddr, timeouts
from ftcore.messages import (
    DEFAULT_JOB,
    Busy,
    ClientEvent,
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
    job_id,
)
from ftcore.pace import PaceJudge, PacePolicy


@dataclass
class LighthouseConfig:
    bind: str = "127.0.0.1:0"
    min_replicas: int = 1  # a floor: a job may ask for more (its ranks send FTCORE_MIN_REPLICAS)
    expected_replicas: int = 0  # groups a job starts with when its ranks do not say (they send R)
    join_timeout: float = timeouts.JOIN_TIMEOUT
    heartbeat_timeout: float = timeouts.HEARTBEAT_TIMEOUT
    failure_probe: float = timeouts.FAILURE_PROBE
    token: str | None = None
    events_file: str | None = None
    lease: float = timeouts.LEASE  # how long a granted quorum may be reused while this lighthouse is silent
    pause_grace: bool = True  # after a pause of its own, wait a heartbeat timeout before judging silence
    pace: PacePolicy = field(default_factory=PacePolicy)  # fail-slow: exclude a group slower than its peers


MAX_JOBS = 256
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

    def __init__(self, lh: "Lighthouse", name: str, num_groups: int, min_replicas: int):
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
        if not self.num_groups and info.num_groups:  # a job first seen without its size learns it
            self.num_groups = info.num_groups
            self.expected = self.expected or self.num_groups
        if grp is None or inc > grp.incarnation:
            if grp is not None:
                self._drop_pending(g)
            grp = self.groups[g] = GroupRecord(g, inc, world)
            self.healthy.discard(g)  # a new incarnation is healthy once the sweep says so
            self.event("register", group=g, incarnation=inc, world=world, step=step)
        rk = grp.ranks.get(r)
        if rk is None:
            rk = grp.ranks[r] = RankRecord(r)
        grp.left = False
        rk.store, rk.heal = info.store or rk.store, info.heal or rk.heal
        rk.step = max(rk.step, step)  # a late heartbeat may carry an older step
        rk.last_beat = time.monotonic()
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
        if grp.left or len(grp.ranks) < grp.world:
            return False
        report = self.reports.get(self.quorum.quorum_id) if self.quorum else None
        in_quorum = self.quorum is not None and grp.group in self.quorum.groups
        silence_counts = not self.lh.in_grace(now)  # a paused lighthouse heard nobody: not their fault
        for rk in grp.ranks.values():
            if rk.disconnected or (silence_counts and now - rk.last_beat > self.cfg.heartbeat_timeout):
                return False
            if report is not None and in_quorum and rk.last_beat < report and now > report + self.cfg.failure_probe:
                return False
        return True

    def _update_health(self, now: float) -> None:
        """O(ranks): run every SWEEP_S, and at once after a disconnect or a failure report."""
        self.lh.notice_pause(now)
        self._last_sweep = now
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

    # ---- quorum ---------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if now - self._last_sweep >= SWEEP_S:
            self._update_health(now)
        if self.pending:
            self._maybe_form(now)
        if now >= self.next_deadline:
            self._expire(now)

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

    def _drop_overtaken(self) -> None:
        """A leased request (sent after its step had gone on without this lighthouse, which
        happens as a pause ends) is for a round its group finishes on its own. Once a peer asks
        for a later step, forming it with that peer would heal the group "up" to a step it
        reaches anyway and leave the peer waiting for a request the group never sends: it
        leaves the round, and the group asks again at the step it is really at."""
        if len(self.pending) < 2:
            return
        top = max(r.step for rs in self.pending.values() for r in rs.values())
        for g in [g for g, rs in self.pending.items() if all(r.leased and r.step < top for r in rs.values())]:
            for req in self._pop(g).values():
                req.deliver(OvertakenReply(top))

    def _maybe_form(self, now: float) -> None:
        """O(groups): one formation attempt on the health of the last sweep."""
        self._drop_overtaken()
        for g in list(self.pending.keys() - self.healthy):
            # The survivors of a group that lost a rank cannot train without it: tell them to
            # exit now (their torchrun or launcher restarts the group) instead of letting them
            # wait out a quorum timeout.
            lost = self.groups[g].lost_rank(
                now, self.cfg.failure_probe, None if self.lh.in_grace(now) else self.cfg.heartbeat_timeout
            )
            if lost is not None:
                for req in self._pop(g).values():
                    req.deliver(QuorumRefused("lost", f"replica group {g} lost rank {lost}; restart the group"))
        if not self.pending:
            return
        healthy = self.healthy - self.excluded.keys()  # a group on standby is not waited for, nor counted
        requesting = sorted(self.complete & healthy)
        round_start = self.round_start if self.round_start is not None else now
        if self.quorum:
            fast = (set(self.quorum.groups) & healthy) <= set(requesting)
        else:  # first quorum (or first after a lighthouse restart): wait for the whole job
            fast = healthy <= set(requesting) and len(requesting) >= self.expected
        waited = now - round_start >= self.cfg.join_timeout
        enough = len(requesting) >= self.min_replicas and 2 * len(requesting) > len(healthy)
        if requesting and enough and (fast or waited):
            self._form(requesting)
        elif now - round_start > 1.0 and now - self._last_wait_event > 1.0:
            self._last_wait_event = now  # say why a round is stuck (status page, timeline)
            self.event(
                "quorum_waiting",
                requesting=requesting,
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
        steps = {g: min(req.step for req in self.pending[g].values()) for g in members}
        busy = self._busy(members)
        idle = self.quorum is not None and all(
            r.idle == self.quorum.quorum_id for g in members for r in self.pending[g].values()
        )
        # Only members of the previous quorum may serve state. A group that was left out
        # (hung, cut off) may have committed a step the others discarded: it heals even
        # at an equal step. After a lighthouse restart, trust the latest reported quorum.
        if self.quorum is not None:
            before = set(self.quorum.identity)
            trusted = [g for g in members if (g, self.groups[g].incarnation) in before]
        else:
            last = {g: min(req.last_quorum for req in self.pending[g].values()) for g in members}
            trusted = [g for g in members if last[g] == max(last.values())]
        trusted = trusted or members
        max_step = max(steps[g] for g in trusted)
        if self.finished_step > max_step:
            # Training ended (a group finished at a later step and left) and nobody here holds
            # that state: these groups must not start a history of their own from an older one.
            for g in members:
                for req in self._pop(g).values():
                    req.deliver(
                        QuorumRefused("finished", f"the job finished at step {self.finished_step}; nothing to rejoin")
                    )
            return
        sources = [g for g in trusted if steps[g] == max_step]
        healers = [g for g in members if g not in sources]
        q = Quorum(
            quorum_id=quorum_id,
            lighthouse_id=lighthouse_id,
            job=self.name,
            identity=identity,
            groups=tuple(members),
            max_step=max_step,
            heal={g: sources[i % len(sources)] for i, g in enumerate(healers)},  # spread over sources
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
        for g in members:
            del self.pending[g]
        self.complete -= set(members)
        self._restart_round()
        for req, reply in replies:
            req.deliver(reply)
        if changed:
            self.event("quorum_formed", quorum_id=quorum_id, groups=members, max_step=max_step, heal=q.shared()["heal"])
        for g in healers:
            self.event("heal_assigned", group=g, source=q.heal[g], step=max_step, quorum_id=quorum_id)
        if idle and self.excluded:  # the work left is the excluded groups' own: let them do it
            self.excluded = dict.fromkeys(self.excluded, 0.0)
        self._judge_pace(busy, members)

    def _replies(self, q: Quorum) -> list[tuple[Request, str]]:
        """Every member rank's reply. Each rank k gets only the two addresses it uses: rank k of
        the first member hosts the rendezvous of every rank k, and a healing rank k fetches
        from rank k of its source. The part every rank shares is encoded once per round."""
        leader = self.groups[q.groups[0]].ranks
        shared = q.shared_json()
        replies = []
        for g in q.groups:
            src = self.groups[q.heal[g]].ranks if g in q.heal else None
            for req in self.pending[g].values():
                store = leader[req.rank].store if req.rank in leader else ""
                heal_from = src[req.rank].heal if src and req.rank in src else ""
                replies.append((req, Quorum.for_rank(shared, store, heal_from)))
        return replies

    # ---- fail-slow --------------------------------------------------------------------
    def _busy(self, members: list[int]) -> dict[int, float]:
        """Each member's compute in the step it just finished in the current quorum (its slowest
        rank's), for members that all ran that step in it and nobody healed: comparable figures."""
        if self.quorum is None or self.quorum.heal:
            return {}
        qid, out = self.quorum.quorum_id, {}
        for g in members:
            figures = [
                r.busy.seconds for r in self.pending[g].values() if r.busy is not None and r.busy.quorum_id == qid
            ]
            if len(figures) == self.groups[g].world:
                out[g] = max(figures)
        return out if len(out) == len(members) else {}

    def _judge_pace(self, busy: dict[int, float], members: list[int]) -> None:
        self.pace.observe(busy)
        verdict = self.pace.judge(
            members, {g: self.groups[g].incarnation for g in members}, self.min_replicas, len(self.excluded)
        )
        if verdict is not None:
            self.excluded[verdict.group] = time.monotonic() + verdict.probation_s
            self.event(
                "group_excluded",
                group=verdict.group,
                incarnation=self.groups[verdict.group].incarnation,
                reason="slower than its peers",
                ratio=verdict.ratio,
                busy_s=verdict.busy_s,
                window=self.cfg.pace.window,
                probation_s=verdict.probation_s,
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
        self.pace.forget(grp.group)
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
            self.next_deadline = min(self.next_deadline, req.deadline)
            reqs = self.pending.setdefault(grp.group, {})
            old = reqs.get(req.rank)
            if old is not None:  # the same rank asking again (a retry): the earlier waiter is gone
                old.deliver(QuorumRefused("superseded", "superseded by a newer request"))
            reqs[req.rank] = req
            if self.round_start is None:
                self.round_start = now
            if len(reqs) == grp.world:  # O(groups) formation only when a group is complete
                self.complete.add(grp.group)
                if not grp.healthy:
                    self._update_health(now)  # a new or returning group need not wait for the sweep
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
    def heartbeat(self, info: RankInfo) -> HeartbeatReply:
        """O(1): the failed list is the last sweep's."""
        with self.lock:
            self._rank(info)
            return HeartbeatReply(self.quorum.quorum_id if self.quorum else 0, tuple(self.failed))

    def disconnected(self, g: int, r: int, inc: int) -> None:
        with self.lock:
            grp = self.groups.get(g)
            if grp is not None and grp.incarnation == inc and r in grp.ranks and not grp.left:
                grp.ranks[r].disconnected, grp.ranks[r].disconnected_at = True, time.monotonic()
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

    def status(self) -> dict[str, Any]:
        with self.lock:
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
                        "ranks": len(g.ranks),
                        "world": g.world,
                        "standby_s": (
                            round(max(self.excluded[g.group] - now, 0.0), 2) if g.group in self.excluded else None
                        ),
                        "last_beat_age_s": max((now - r.last_beat for r in g.ranks.values()), default=None),
                    }
                    for g in sorted(self.groups.values(), key=lambda g: g.group)
                ],
            }


class Lighthouse:
    """The control plane of every job that reports to it (one `Job` each, by job id)."""

    def __init__(self, cfg: LighthouseConfig):
        self.cfg = cfg
        # this start of the lighthouse (ftcore/messages.py): store prefixes differ across restarts
        self.lighthouse_id = secrets.token_hex(4)
        self._jobs_lock = threading.Lock()
        self.jobs: dict[str, Job] = {}
        self._events_lock = threading.Lock()
        self.events: collections.deque = collections.deque(maxlen=2000)
        self.started = time.time()
        self._events_file = open(cfg.events_file, "a") if cfg.events_file else None
        self._stop = threading.Event()
        self._pause_lock = threading.Lock()
        self.alive_at = time.monotonic()  # the last time this process was seen running
        self.grace_until = 0.0  # after a pause: silence is not judged before this
        self._ticker = threading.Thread(target=self._tick, daemon=True, name="lighthouse-tick")
        self._ticker.start()
        self.event("lighthouse_started", lighthouse_id=self.lighthouse_id, min_replicas=cfg.min_replicas)

    def event(self, kind: str, **data: Any) -> None:
        ev = {"t": time.time(), "kind": kind, **data}
        line = json.dumps(ev)
        with self._events_lock:
            self.events.append(ev)
            print(line, flush=True)
            if self._events_file:
                self._events_file.write(line + "\n")
                self._events_file.flush()

    def job(self, info: RankInfo) -> Job:
        """The job a rank belongs to, created by its first message (a checked one: a bad
        message creates no job)."""
        with self._jobs_lock:
            j = self.jobs.get(info.job)
            if j is None:
                if len(self.jobs) >= MAX_JOBS:
                    raise ValueError(f"this lighthouse already serves {MAX_JOBS} jobs")
                j = self.jobs[info.job] = Job(self, info.job, info.num_groups, info.min_replicas)
            return j

    def notice_pause(self, now: float) -> None:
        """Called by the ticker every TICK_S and before every health sweep: a gap far longer
        than a tick means this process was stopped (SIGSTOP, a frozen VM, a long GC) and
        heard nobody meanwhile, so it grants every rank a heartbeat timeout to be heard again."""
        with self._pause_lock:
            gap = now - self.alive_at
            self.alive_at = max(self.alive_at, now)
            if gap > timeouts.PAUSE_JUMP and self.cfg.pause_grace:
                self.grace_until = now + self.cfg.heartbeat_timeout
                self.event("lighthouse_paused", seconds=round(gap, 3), grace_s=self.cfg.heartbeat_timeout)

    def in_grace(self, now: float) -> bool:
        return now < self.grace_until

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            self.notice_pause(time.monotonic())
            for j in list(self.jobs.values()):
                try:
                    with j.lock:
                        j.tick(time.monotonic())
                except Exception as e:  # never let one job's bad state end every job's rounds
                    self.event("tick_error", job=j.name, error=f"{type(e).__name__}: {e}"[:300])

    # ---- messages for a job that may not exist (never created by them) ----------------------
    def report_failure(self, report: FailureReport) -> None:
        j = self.jobs.get(report.job)
        if j is not None:
            j.report_failure(report)

    def leave(self, info: RankInfo) -> None:
        j = self.jobs.get(info.job)
        if j is not None:
            j.leave(info)

    def client_event(self, ev: ClientEvent) -> None:
        self.event(ev.kind, **ev.data, job=ev.job)

    def status(self, job: str = DEFAULT_JOB) -> dict[str, Any]:
        j = self.jobs.get(job)
        st = (
            j.status()
            if j
            else {"job": job, "min_replicas": self.cfg.min_replicas, "max_step": 0, "quorum": None, "groups": []}
        )
        with self._events_lock:
            events = [e for e in self.events if e.get("job", job) == job][-100:]
        return {
            "lighthouse_id": self.lighthouse_id,
            "uptime_s": time.time() - self.started,
            "jobs": sorted(self.jobs),
            **st,
            "events": events,
        }

    def close(self) -> None:
        self._stop.set()


def _status_html(st: dict[str, Any]) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(str(g['group']))}</td><td>{e(str(g['incarnation']))}</td>"
        f"<td>{'standby (slow)' if g.get('standby_s') else 'yes' if g['healthy'] else 'no'}</td>"
        f"<td>{e(str(g['step']))}</td><td>{e(str(g['ranks']))}/{e(str(g['world']))}</td></tr>"
        for g in st["groups"]
    )
    q = st["quorum"] or {}
    evs = "".join(
        f"<li>{time.strftime('%H:%M:%S', time.localtime(float(ev.get('t', 0))))} {e(json.dumps(ev))}</li>"
        for ev in reversed(st["events"][-30:])
    )
    jobs = ", ".join(f"<a href='?job={e(urllib.parse.quote(j))}'>{e(j)}</a>" for j in st["jobs"]) or "none yet"
    return (
        "<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='2'>"
        "<title>ftcore lighthouse</title></head><body style='font-family:sans-serif'>"
        f"<h1>ftcore lighthouse</h1><p>jobs: {jobs}</p><h2>job {e(st['job'])}</h2>"
        f"<p>quorum {e(str(q.get('quorum_id', '-')))}: groups {e(str(q.get('groups', [])))}, "
        f"max committed step {e(str(st['max_step']))}, min replicas {e(str(st['min_replicas']))}</p>"
        "<table border=1 cellpadding=4><tr><th>group</th><th>incarnation</th><th>healthy</th>"
        f"<th>step</th><th>ranks</th></tr>{rows}</table><h2>recent events</h2><ul>{evs}</ul></body></html>"
    )


# ---- the HTTP server ---------------------------------------------------------------------
# One asyncio loop in one thread serves every connection as a protocol object: a rank's
# heartbeat connection and its quorum connection cost no thread and no task; a quorum
# request is answered when formation delivers its reply. Every request is bounded before
# it is read.
MAX_BODY = 1 << 20  # bytes: larger bodies get 413
MAX_HEADERS = 64
MAX_HEAD = 16 << 10  # bytes of request line and headers
FIRST_REQUEST_S = 10.0  # a new connection must send its first request within this
IDLE_S = 600.0  # a quiet connection that is not a rank's heartbeat line is closed after this
REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    409: "Conflict",
    410: "Gone",
    413: "Payload Too Large",
    431: "Request Header Fields Too Large",
    504: "Gateway Timeout",
}


class _BadRequest(Exception):
    def __init__(self, code: int, msg: str):
        super().__init__(msg)
        self.code = code


def _response(code: int, body: Any, ctype: str = "application/json") -> bytes:
    """`body`: an object to encode as JSON, or text already encoded (a quorum reply, HTML)."""
    raw = (body if isinstance(body, str) else json.dumps(body)).encode()
    head = (
        f"HTTP/1.1 {code} {REASONS.get(code, 'Error')}\r\nContent-Type: {ctype}\r\nContent-Length: {len(raw)}\r\n\r\n"
    )
    return head.encode() + raw  # one write: no Nagle wait between headers and body


class _Connection(asyncio.Protocol):
    """One client connection: requests parsed from the byte stream as they arrive, answered in
    order (a quorum request's answer is written when its round forms). No task, no thread."""

    def __init__(self, server: "LighthouseServer"):
        self.srv = server
        self.buf = bytearray()
        self.busy = False  # a request is being answered: later bytes wait (no reordering)
        self.beat: tuple[Job, int, int, int] | None = None  # this connection's heartbeating rank
        self.waiting: tuple[Job, Request] | None = None  # its pending quorum request
        self.opened = self.last = time.monotonic()
        self.served = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t: asyncio.Transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.srv.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.srv.conns.discard(self)
        if self.waiting is not None:
            job, req = self.waiting
            job.withdraw(req)
        if self.beat is not None:
            job, g, r, inc = self.beat
            job.disconnected(g, r, inc)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.last = time.monotonic()
        self._next()

    def _next(self) -> None:
        while not self.busy and not self.t.is_closing():
            try:
                req = self._parse()
            except _BadRequest as e:
                self.t.write(_response(e.code, {"error": str(e)}))
                self.t.close()
                return
            if req is None:
                return
            self.busy = True
            self.srv.dispatch(self, *req)

    def _parse(self) -> tuple[str, str, dict[str, str], bytes] | None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEAD:
                raise _BadRequest(431, f"request head over {MAX_HEAD} bytes")
            return None
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest(400, "malformed request line")
        if len(lines) > MAX_HEADERS:
            raise _BadRequest(431, "too many headers")
        headers = {}
        for h in lines[1:]:
            name, sep, value = h.partition(":")
            if not sep:
                raise _BadRequest(400, "malformed header")
            headers[name.strip().lower()] = value.strip()
        raw = headers.get("content-length", "0")
        if not (raw.isascii() and raw.isdigit()):
            raise _BadRequest(400, "Content-Length is not a number")
        n = int(raw)
        if n > MAX_BODY:
            raise _BadRequest(413, f"body over {MAX_BODY} bytes")
        if len(self.buf) < end + 4 + n:
            return None
        body = bytes(self.buf[end + 4 : end + 4 + n])
        del self.buf[: end + 4 + n]
        return parts[0], parts[1], headers, body

    def reply(self, code: int, body: Any, ctype: str = "application/json") -> None:
        """In the loop's thread only."""
        self.waiting = None
        if self.t.is_closing():
            return
        self.t.write(_response(code, body, ctype))
        self.busy = False
        self.served += 1
        self.last = time.monotonic()
        if self.buf:
            self._next()


class LighthouseServer:
    """The lighthouse's HTTP/1.1 front end: one asyncio loop (stdlib) in a daemon thread."""

    def __init__(self, lh: Lighthouse, host: str, port: int):
        self.lh = lh
        self.loop = asyncio.new_event_loop()
        self.conns: set[_Connection] = set()
        self._started = threading.Event()
        self._error: OSError | None = None
        self.server_address: tuple = ()
        self._thread = threading.Thread(target=self._run, args=(host, port), daemon=True, name="lighthouse-http")
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _run(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self._srv = self.loop.run_until_complete(
                self.loop.create_server(lambda: _Connection(self), host, port, backlog=1024)
            )
            self.server_address = self._srv.sockets[0].getsockname()[:2]
        except OSError as e:
            self._error = e
        self._started.set()
        if self._error is None:
            self.loop.call_later(1.0, self._sweep)
            self.loop.run_forever()

    def _sweep(self) -> None:
        """Close connections that never spoke or went quiet (not a rank's heartbeat line: a
        stopped rank's silence is for the heartbeat timeout to judge)."""
        now = time.monotonic()
        for c in list(self.conns):
            if (
                c.beat is None
                and not c.busy
                and ((c.served == 0 and now - c.opened > FIRST_REQUEST_S) or now - c.last > IDLE_S)
            ):
                c.t.close()
        self.loop.call_later(1.0, self._sweep)

    def shutdown(self) -> None:
        def stop() -> None:
            self._srv.close()
            for c in list(self.conns):
                c.t.abort()
            self.loop.stop()

        if self.loop.is_running():
            self.loop.call_soon_threadsafe(stop)
            self._thread.join(timeout=5)

    def dispatch(self, conn: _Connection, method: str, target: str, headers: dict[str, str], raw: bytes) -> None:
        url = urllib.parse.urlparse(target)
        # header only: a token in a URL ends up in logs, histories and Referer headers
        if not auth.allowed(self.lh.cfg.token, headers.get("authorization")):
            return conn.reply(401, {"error": "missing or wrong token"})
        lh = self.lh
        try:
            if method == "GET":
                job = job_id(urllib.parse.parse_qs(url.query).get("job", [DEFAULT_JOB])[0])
                if url.path == "/status":
                    return conn.reply(200, lh.status(job))
                if url.path in ("/", "/index.html"):
                    return conn.reply(200, _status_html(lh.status(job)), "text/html; charset=utf-8")
                return conn.reply(404, {"error": f"no such path {url.path}"})
            if method != "POST":
                return conn.reply(404, {"error": f"no {method} here"})
            msg = json.loads(raw.decode("utf-8") or "{}", parse_constant=_no_constant)
            path = url.path
            if path == "/heartbeat":
                info = RankInfo.parse(msg)
                job_ = lh.job(info)
                reply = job_.heartbeat(info)  # validates: only then is this connection a rank's
                conn.beat = (job_, info.group, info.rank, info.incarnation)
                return conn.reply(200, reply.to_wire())
            if path == "/quorum":
                ask = QuorumRequest.parse(msg)
                return self._quorum(conn, lh.job(ask.info), ask)
            if path == "/report_failure":
                lh.report_failure(FailureReport.parse(msg))
            elif path == "/leave":
                lh.leave(RankInfo.parse(msg))
                conn.beat = None
            elif path == "/event":
                lh.client_event(ClientEvent.parse(msg))
            else:
                return conn.reply(404, {"error": f"no such path {path}"})
            conn.reply(200, {})
        except StaleIncarnation as e:
            conn.beat = None
            conn.reply(409, {"error": str(e)})
        except (KeyError, ValueError, TypeError, UnicodeDecodeError, RecursionError) as e:
            conn.reply(400, {"error": f"bad request: {e!r}"[:500]})

    def _quorum(self, conn: _Connection, job: Job, ask: QuorumRequest) -> None:
        loop_thread = threading.get_ident()

        def answer(reply: str | Answer) -> None:
            if isinstance(reply, str):  # a quorum, encoded for this rank
                conn.reply(Quorum.status, reply)
            else:
                conn.reply(reply.status, reply.to_wire())

        def deliver(reply: str | Answer) -> None:  # under the job's lock: the ticker's thread or this loop's
            if threading.get_ident() == loop_thread:
                self.loop.call_soon(answer, reply)  # after this request's own dispatch has returned
            else:
                self.loop.call_soon_threadsafe(answer, reply)

        conn.waiting = (job, job.enqueue(ask, deliver, min(ask.timeout, timeouts.QUORUM_TIMEOUT)))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def serve(cfg: LighthouseConfig) -> tuple[LighthouseServer, Lighthouse]:
    """Start a lighthouse server in background threads; returns (server, lighthouse)."""
    host, _, port = cfg.bind.rpartition(":")
    lh = Lighthouse(cfg)
    try:
        server = LighthouseServer(lh, host.strip("[]") or "127.0.0.1", int(port))
    except OSError:
        lh.close()
        raise
    return server, lh


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftcore.lighthouse", description=__doc__.split("\n\n")[0])
    p.add_argument("--bind", default="127.0.0.1:29510", help="host:port to listen on (loopback by default)")
    p.add_argument("--min-replicas", type=int, default=1, help="fewest replica groups a quorum may have")
    p.add_argument(
        "--expected-replicas",
        type=int,
        default=0,
        help="groups the job starts with: the first quorum waits for all of them or the join timeout",
    )
    p.add_argument("--join-timeout", type=float, default=timeouts.JOIN_TIMEOUT)
    p.add_argument("--heartbeat-timeout", type=float, default=timeouts.HEARTBEAT_TIMEOUT)
    p.add_argument("--token-file", help="file holding the shared token (else FTCORE_TOKEN / FTCORE_TOKEN_FILE)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve without a token (loopback binds only): anyone who reaches it can steer every job",
    )
    p.add_argument("--events-file", help="append every event to this JSON-lines file")
    p.add_argument(
        "--lease",
        type=float,
        default=timeouts.LEASE,
        help="seconds a group may go on in its last quorum while this lighthouse is silent (0: never)",
    )
    p.add_argument(
        "--no-pause-grace",
        action="store_true",
        help="judge heartbeat timeouts at once after this process was paused (for comparison only)",
    )
    pace = PacePolicy()
    p.add_argument(
        "--slow-ratio",
        type=float,
        default=pace.ratio,
        help="fail-slow: exclude a group whose compute is this many times its peers' (0: never; FTCORE_SLOW_RATIO)",
    )
    p.add_argument(
        "--slow-window", type=int, default=pace.window, help="... for this many consecutive rounds (FTCORE_SLOW_WINDOW)"
    )
    p.add_argument(
        "--slow-probation",
        type=float,
        default=pace.probation_s,
        help="seconds an excluded group waits before it may rejoin; doubles each time (FTCORE_SLOW_PROBATION)",
    )
    a = p.parse_args(argv)
    if a.min_replicas < 1:
        print("ftcore.lighthouse: --min-replicas must be >= 1", file=sys.stderr)
        return 2
    try:
        pace = PacePolicy(a.slow_ratio, a.slow_window, a.slow_probation, pace.min_excess_s).check()
    except ValueError as e:
        print(f"ftcore.lighthouse: {e}", file=sys.stderr)
        return 2
    token = auth.read_token_file(a.token_file) if a.token_file else auth.token_from_env()
    if token is None and not a.insecure:
        print(
            "ftcore.lighthouse: no token; give --token-file, or set FTCORE_TOKEN / FTCORE_TOKEN_FILE "
            "(or --insecure on a loopback --bind for a throwaway run)",
            file=sys.stderr,
        )
        return 2
    if token is None and not netaddr.is_loopback(a.bind.rpartition(":")[0].strip("[]") or "127.0.0.1"):
        print(
            f"ftcore.lighthouse: refusing to serve {a.bind} without a token: --insecure is for loopback "
            "binds only; give --token-file",
            file=sys.stderr,
        )
        return 2
    cfg = LighthouseConfig(
        a.bind,
        a.min_replicas,
        a.expected_replicas,
        a.join_timeout,
        a.heartbeat_timeout,
        token=token,
        events_file=a.events_file,
        lease=max(a.lease, 0.0),
        pause_grace=not a.no_pause_grace,
        pace=pace,
    )
    try:
        server, lh = serve(cfg)
    except OSError as e:
        print(f"ftcore.lighthouse: cannot listen on {a.bind}: {e.strerror}; choose another --bind", file=sys.stderr)
        return 2
    print(
        json.dumps({"t": time.time(), "kind": "listening", "address": "{}:{}".format(*server.server_address[:2])}),
        flush=True,
    )
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
