"""The lighthouse: FT-HSDP's control plane (membership, quorum, heal assignments, events).

Every rank of every replica group registers, heartbeats, and asks for a quorum once
per step. A quorum round answers all ranks of all participating groups at once with
the same `quorum_id` (the membership epoch: it grows whenever the set of participating
group incarnations changes), the highest committed step, and which groups must heal
from which up-to-date group. A failed group is noticed three ways:

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
(same id and epoch: nobody rebuilds a process group), else a new id above any reported.
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
import re
import secrets
import socket
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable

from ftcore import auth, netaddr, timeouts
from ftcore.pace import PaceJudge, PacePolicy


@dataclass
class LighthouseConfig:
    bind: str = "127.0.0.1:0"
    min_replicas: int = 1          # a floor: a job may ask for more (its ranks send FTCORE_MIN_REPLICAS)
    expected_replicas: int = 0     # groups a job starts with when its ranks do not say (they send R)
    join_timeout: float = timeouts.JOIN_TIMEOUT
    heartbeat_timeout: float = timeouts.HEARTBEAT_TIMEOUT
    failure_probe: float = timeouts.FAILURE_PROBE
    token: str | None = None
    events_file: str | None = None
    lease: float = timeouts.LEASE      # how long a granted quorum may be reused while this lighthouse is silent
    pause_grace: bool = True           # after a pause of its own, wait a heartbeat timeout before judging silence
    pace: PacePolicy = field(default_factory=PacePolicy)   # fail-slow: exclude a group slower than its peers


# Bounds on what a client may send: ids the lighthouse cannot plan for are refused at the door.
DEFAULT_JOB = "default"
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+@=-]{0,127}")
MAX_GROUPS = 1 << 16       # replica groups per job
MAX_WORLD = 1 << 16        # ranks per replica group
MAX_ID = 1 << 53           # steps, incarnations, quorum ids: integers JSON carries exactly
MAX_JOBS = 256
TICK_S = 0.01              # formation rounds: how often a waiting round re-checks its members
SWEEP_S = 0.05             # health sweeps over every rank (disconnects and reports act at once)


@dataclass
class Rank:
    rank: int
    store: str = ""        # host:port of this rank's TCPStore (rendezvous for cross-group groups)
    heal: str = ""         # host:port of this rank's heal server
    step: int = 0          # committed steps
    last_beat: float = 0.0
    disconnected: bool = False
    disconnected_at: float = 0.0


@dataclass
class Group:
    group: int
    incarnation: int
    world: int             # ranks per group (K)
    ranks: dict[int, Rank] = field(default_factory=dict)
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
                    heartbeat_timeout is not None and now - rk.last_beat > heartbeat_timeout):
                return rk.rank
        return None


@dataclass
class Request:
    group: int
    rank: int
    incarnation: int
    step: int
    t: float          # monotonic time of arrival
    last_quorum: int  # the last quorum id this rank trained in
    last_epoch: str   # ... the epoch of the lighthouse that formed it, and its identity
    last_identity: list
    deliver: Callable[[dict[str, Any] | str], None]   # hands the reply to the waiter: a quorum (JSON text) or an error
    deadline: float = math.inf   # monotonic: past it the request is answered with a timeout
    busy: tuple[int, float] | None = None   # (quorum id, seconds) of its last step's compute (ftcore/pace.py)
    idle: int = -1   # the quorum id of its last step if nobody had work in it (only absent groups' is left)
    leased: bool = False   # sent after its step had gone on without this lighthouse: its sender ignores the reply


class StaleIncarnation(Exception):
    """A message from a process of a group incarnation that has been replaced."""


def _int(msg: dict[str, Any], key: str, default: int | None = None, lo: int = 0, hi: int = MAX_ID) -> int:
    """msg[key] as an int in [lo, hi); ValueError (a 400) otherwise."""
    raw = msg.get(key, default)
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise ValueError(f"{key} must be an integer, got {raw!r}")
    value = int(raw)
    if not lo <= value < hi:
        raise ValueError(f"{key}={value} is outside [{lo}, {hi})")
    return value


def rank_fields(msg: dict[str, Any], num_groups: int) -> tuple[int, int, int, int, int, int, str, str]:
    """(group, world, rank, incarnation, step, quorum_id, store, heal) of a rank's message,
    each checked (ValueError names the field); nothing is changed."""
    g = _int(msg, "group", hi=num_groups or MAX_GROUPS)
    world = _int(msg, "world", 1, lo=1, hi=MAX_WORLD)
    r = _int(msg, "rank", hi=world)
    inc, step, qid = _int(msg, "incarnation", 0), _int(msg, "step", 0), _int(msg, "quorum_id", 0)
    store, heal = msg.get("store", ""), msg.get("heal", "")
    if not (isinstance(store, str) and isinstance(heal, str) and len(store) <= 256 and len(heal) <= 256):
        raise ValueError("store and heal must be host:port strings")
    return g, world, r, inc, step, qid, store, heal


def _busy_field(msg: dict[str, Any]) -> tuple[int, float] | None:
    """A quorum request's [quorum id, seconds] of compute in its last step, or None."""
    raw = msg.get("busy")
    if raw is None:
        return None
    if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[1], (int, float))
            and not isinstance(raw[1], bool) and 0 <= raw[1] < 1e6):
        raise ValueError(f"busy must be [quorum_id, seconds], got {raw!r}"[:200])
    return _int({"quorum_id": raw[0]}, "quorum_id"), float(raw[1])


def job_id(msg: dict[str, Any]) -> str:
    job = msg.get("job") or DEFAULT_JOB
    if not isinstance(job, str) or not JOB_ID.fullmatch(job):
        raise ValueError(f"job id {job!r} must match {JOB_ID.pattern}")
    return job


class Job:
    """One training job's membership and quorum: groups, pending quorum requests, heals.

    Each job has its own lock, so jobs served by one lighthouse never wait on each other."""

    def __init__(self, lh: "Lighthouse", name: str, num_groups: int, min_replicas: int):
        self.lh, self.cfg, self.name = lh, lh.cfg, name
        self.num_groups = num_groups           # 0: not declared by the ranks (any group id up to MAX_GROUPS)
        self.min_replicas = max(lh.cfg.min_replicas, min_replicas)
        self.expected = num_groups or lh.cfg.expected_replicas
        self.lock = threading.Lock()
        self.groups: dict[int, Group] = {}
        self.quorum: dict[str, Any] | None = None
        self.quorum_id = 0
        self.max_step = 0
        self.pending: dict[int, dict[int, Request]] = {}
        self.complete: set[int] = set()         # groups all of whose ranks are pending: formation looks at these
        self.round_start: float | None = None   # arrival of this round's first pending request
        self.next_deadline = math.inf           # the earliest deadline among pending requests
        self.finished_step = 0                  # the highest step a group that finished (left) reached
        self._last_wait_event = 0.0
        self._last_sweep = 0.0
        self.failed: list[int] = []  # members of the current quorum that are not healthy (for heartbeats)
        self.healthy: set[int] = set()   # groups healthy at the last sweep (kept with Group.healthy)
        self.force_new = False  # a data-plane failure: the next quorum gets a new id, whoever is in it
        self.reports: dict[int, float] = {}  # quorum_id -> time of the first data-plane failure report
        self.pace = PaceJudge(lh.cfg.pace)
        self.excluded: dict[int, float] = {}   # fail-slow: group -> monotonic end of its standby

    def event(self, kind: str, **data: Any) -> None:
        self.lh.event(kind, job=self.name, **data)

    # ---- membership ---------------------------------------------------------------
    def _rank(self, msg: dict[str, Any]) -> tuple[Group, Rank]:
        """Find or register the sender of `msg` (group, rank, world, incarnation, ...).

        Every field is checked before anything changes: a bad message is a 400, never state."""
        if not self.num_groups and msg.get("num_groups"):   # a job first seen without its size learns it
            self.num_groups = _int(msg, "num_groups", hi=MAX_GROUPS)
            self.expected = self.expected or self.num_groups
        g, world, r, inc, step, qid, store, heal = rank_fields(msg, self.num_groups)
        grp = self.groups.get(g)
        if grp is not None and inc < grp.incarnation:
            raise StaleIncarnation(f"group {g} incarnation {inc} was replaced by {grp.incarnation}")
        if grp is not None and inc == grp.incarnation and world != grp.world:
            raise ValueError(f"group {g} incarnation {inc} has {grp.world} ranks, this rank says {world}")
        if grp is None or inc > grp.incarnation:
            if grp is not None:
                self._drop_pending(g)
            grp = self.groups[g] = Group(g, inc, world)
            self.healthy.discard(g)   # a new incarnation is healthy once the sweep says so
            self.event("register", group=g, incarnation=inc, world=world, step=step)
        rk = grp.ranks.get(r)
        if rk is None:
            rk = grp.ranks[r] = Rank(r)
        grp.left = False
        rk.store, rk.heal = store or rk.store, heal or rk.heal
        rk.step = max(rk.step, step)  # a late heartbeat may carry an older step
        rk.last_beat = time.monotonic()
        if rk.disconnected:
            rk.disconnected = False
            self._last_sweep = 0.0
        self.max_step = max(self.max_step, rk.step)
        # After a lighthouse restart, quorum ids resume above any a member has seen.
        self.quorum_id = max(self.quorum_id, qid)
        return grp, rk

    def _drop_pending(self, g: int) -> None:
        for req in self._pop(g).values():
            req.deliver({"error": "stale incarnation"})

    def _is_healthy(self, grp: Group, now: float) -> bool:
        if grp.left or len(grp.ranks) < grp.world:
            return False
        report = self.reports.get(self.quorum["quorum_id"]) if self.quorum else None
        in_quorum = self.quorum is not None and grp.group in self.quorum["groups"]
        silence_counts = not self.lh.in_grace(now)   # a paused lighthouse heard nobody: not their fault
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
                    why = ("connection closed" if any(r.disconnected for r in grp.ranks.values())
                           else "heartbeat timeout")
                    self.event("failure_detected", group=grp.group, incarnation=grp.incarnation, reason=why)
        self.failed = [g for g in (self.quorum["groups"] if self.quorum else [])
                       if g in self.groups and not self.groups[g].healthy]

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
                    req.deliver({"error": "timeout waiting for a quorum"})
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
                req.deliver({"overtaken": True, "step": top})

    def _maybe_form(self, now: float) -> None:
        """O(groups): one formation attempt on the health of the last sweep."""
        self._drop_overtaken()
        for g in list(self.pending.keys() - self.healthy):
            # The survivors of a group that lost a rank cannot train without it: tell them to
            # exit now (their torchrun or launcher restarts the group) instead of letting them
            # wait out a quorum timeout.
            lost = self.groups[g].lost_rank(now, self.cfg.failure_probe,
                                            None if self.lh.in_grace(now) else self.cfg.heartbeat_timeout)
            if lost is not None:
                for req in self._pop(g).values():
                    req.deliver({"error": f"replica group {g} lost rank {lost}; restart the group", "lost": True})
        if not self.pending:
            return
        healthy = self.healthy - self.excluded.keys()   # a group on standby is not waited for, nor counted
        requesting = sorted(self.complete & healthy)
        round_start = self.round_start if self.round_start is not None else now
        if self.quorum:
            fast = (set(self.quorum["groups"]) & healthy) <= set(requesting)
        else:  # first quorum (or first after a lighthouse restart): wait for the whole job
            fast = healthy <= set(requesting) and len(requesting) >= self.expected
        waited = now - round_start >= self.cfg.join_timeout
        enough = len(requesting) >= self.min_replicas and 2 * len(requesting) > len(healthy)
        if requesting and enough and (fast or waited):
            self._form(requesting)
        elif now - round_start > 1.0 and now - self._last_wait_event > 1.0:
            self._last_wait_event = now  # say why a round is stuck (status page, timeline)
            self.event("quorum_waiting", requesting=requesting, healthy=sorted(healthy),
                       pending={str(g): sorted(r) for g, r in self.pending.items()},
                       previous=self.quorum["groups"] if self.quorum else None, seconds=round(now - round_start, 2))

    def _resumed(self, members: list[int], identity: list) -> tuple[int, str] | None:
        """After a restart of this lighthouse: the (quorum id, epoch) its members all last
        trained in, when that quorum had exactly this membership. Resuming it keeps their
        process groups (and a group that went on without this lighthouse, on its lease, in step)."""
        reqs = [r for g in members for r in self.pending[g].values()]
        first = reqs[0]
        if first.last_epoch and first.last_identity == identity and all(
                (r.last_quorum, r.last_epoch, r.last_identity) == (first.last_quorum, first.last_epoch, identity)
                for r in reqs):
            return first.last_quorum, first.last_epoch
        return None

    def _form(self, members: list[int]) -> None:
        """Build the whole quorum and every rank's reply first, then change state."""
        identity = [[g, self.groups[g].incarnation] for g in members]
        resumed = self._resumed(members, identity) if self.quorum is None and not self.force_new else None
        new_id = self.quorum is None or self.quorum["identity"] != identity or self.force_new
        quorum_id = self.quorum_id + 1 if new_id else self.quorum_id
        epoch = self.quorum["epoch"] if self.quorum is not None and not new_id else self.lh.epoch
        if resumed is not None:
            quorum_id, epoch = resumed
        steps = {g: min(req.step for req in self.pending[g].values()) for g in members}
        busy = self._busy(members)
        idle = self.quorum is not None and all(r.idle == self.quorum["quorum_id"]
                                               for g in members for r in self.pending[g].values())
        # Only members of the previous quorum may serve state. A group that was left out
        # (hung, cut off) may have committed a step the others discarded: it heals even
        # at an equal step. After a lighthouse restart, trust the latest reported quorum.
        if self.quorum is not None:
            before = {(g, inc) for g, inc in self.quorum["identity"]}
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
                    req.deliver({"error": f"the job finished at step {self.finished_step}; nothing to rejoin",
                                 "finished": True})
            return
        sources = [g for g in trusted if steps[g] == max_step]
        healers = [g for g in members if g not in sources]
        heal = {str(g): sources[i % len(sources)] for i, g in enumerate(healers)}  # spread over sources
        q = {"quorum_id": quorum_id, "epoch": epoch, "job": self.name, "identity": identity,
             "groups": members, "max_step": max_step, "heal": heal, "lease_s": self.cfg.lease,
             # the members' compute in the step they just finished: each sees its wait for the slowest
             "pace": [self.quorum["quorum_id"], round(max(busy.values()), 6),
                      round(sum(busy.values()) / len(busy), 6)] if busy else None}
        # Each rank k gets only the two addresses it uses: rank k of the first member hosts the
        # rendezvous of every rank k, and a healing rank k fetches from rank k of its source.
        # The part every rank shares is encoded once per round, not once per rank.
        leader = self.groups[members[0]].ranks
        common = json.dumps(q)[:-1]
        replies = []
        for g in members:
            src = self.groups[heal[str(g)]].ranks if str(g) in heal else None
            for req in self.pending[g].values():
                store = leader[req.rank].store if req.rank in leader else ""
                heal_from = src[req.rank].heal if src and req.rank in src else ""
                replies.append((req, f'{common}, "store": {json.dumps(store)}, "heal_from": {json.dumps(heal_from)}}}'))
        changed = self.quorum is None or self.quorum["quorum_id"] != quorum_id or self.quorum["epoch"] != epoch
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
            self.event("quorum_formed", quorum_id=quorum_id, groups=members, max_step=max_step, heal=heal)
        for g in healers:
            self.event("heal_assigned", group=g, source=heal[str(g)], step=max_step, quorum_id=quorum_id)
        if idle and self.excluded:   # the work left is the excluded groups' own: let them do it
            self.excluded = dict.fromkeys(self.excluded, 0.0)
        self._judge_pace(busy, members)

    # ---- fail-slow --------------------------------------------------------------------
    def _busy(self, members: list[int]) -> dict[int, float]:
        """Each member's compute in the step it just finished in the current quorum (its slowest
        rank's), for members that all ran that step in it and nobody healed: comparable figures."""
        if self.quorum is None or self.quorum["heal"]:
            return {}
        qid, out = self.quorum["quorum_id"], {}
        for g in members:
            figures = [r.busy[1] for r in self.pending[g].values() if r.busy is not None and r.busy[0] == qid]
            if len(figures) == self.groups[g].world:
                out[g] = max(figures)
        return out if len(out) == len(members) else {}

    def _judge_pace(self, busy: dict[int, float], members: list[int]) -> None:
        self.pace.observe(busy)
        verdict = self.pace.judge(members, {g: self.groups[g].incarnation for g in members}, self.min_replicas,
                                  len(self.excluded))
        if verdict is not None:
            self.excluded[verdict.group] = time.monotonic() + verdict.probation_s
            self.event("group_excluded", group=verdict.group, incarnation=self.groups[verdict.group].incarnation,
                       reason="slower than its peers", ratio=verdict.ratio, busy_s=verdict.busy_s,
                       window=self.cfg.pace.window, probation_s=verdict.probation_s)

    def _standby(self, grp: Group, now: float) -> dict[str, Any] | None:
        """The answer to a quorum request of an excluded group while its probation lasts."""
        until = self.excluded.get(grp.group)
        if until is None:
            return None
        if now < until and not self.finished_step:   # once the job ends there is nothing to wait for
            return {"standby": True, "retry_s": round(min(until - now, 1.0), 3),
                    "reason": f"excluded as slower than its peers for {until - now:.1f}s more"}
        del self.excluded[grp.group]
        self.pace.forget(grp.group)
        self.event("group_readmitted", group=grp.group, incarnation=grp.incarnation)
        return None

    def enqueue(self, msg: dict[str, Any], deliver: Callable[[dict[str, Any] | str], None],
                timeout: float) -> Request:
        """A rank's quorum request joins this round; `deliver` gets the reply when it forms
        (maybe at once: this arrival may complete the round; the ticker does the rest), or a
        timeout error after `timeout` seconds."""
        with self.lock:
            identity = msg.get("quorum_identity") or []
            epoch = msg.get("quorum_epoch") or ""
            if not (isinstance(identity, list) and len(identity) <= MAX_GROUPS and isinstance(epoch, str)
                    and len(epoch) <= 64):
                raise ValueError("quorum_identity must be a list of [group, incarnation], quorum_epoch a string")
            busy, idle = _busy_field(msg), _int(msg, "idle", -1, lo=-1)
            leased = msg.get("leased", False)
            if not isinstance(leased, bool):
                raise ValueError(f"leased must be true or false, got {leased!r}"[:200])
            grp, _ = self._rank(msg)
            now = time.monotonic()
            req = Request(grp.group, int(msg["rank"]), grp.incarnation, int(msg.get("step", 0)), now,
                          int(msg.get("quorum_id", 0)), epoch, identity, deliver, now + timeout, busy, idle, leased)
            standby = self._standby(grp, now)
            if standby is not None:
                deliver(standby)
                return req
            self.next_deadline = min(self.next_deadline, req.deadline)
            reqs = self.pending.setdefault(grp.group, {})
            old = reqs.get(req.rank)
            if old is not None:   # the same rank asking again (a retry): the earlier waiter is gone
                old.deliver({"error": "superseded by a newer request"})
            reqs[req.rank] = req
            if self.round_start is None:
                self.round_start = now
            if len(reqs) == grp.world:   # O(groups) formation only when a group is complete
                self.complete.add(grp.group)
                if not grp.healthy:
                    self._update_health(now)   # a new or returning group need not wait for the sweep
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
    def heartbeat(self, msg: dict[str, Any]) -> dict[str, Any]:
        """O(1): the failed list is the last sweep's."""
        with self.lock:
            self._rank(msg)
            return {"quorum_id": self.quorum["quorum_id"] if self.quorum else 0, "failed": self.failed}

    def register(self, msg: dict[str, Any]) -> None:
        with self.lock:
            self._rank(msg)

    def disconnected(self, g: int, r: int, inc: int) -> None:
        with self.lock:
            grp = self.groups.get(g)
            if grp is not None and grp.incarnation == inc and r in grp.ranks and not grp.left:
                grp.ranks[r].disconnected, grp.ranks[r].disconnected_at = True, time.monotonic()
                self._update_health(time.monotonic())
                if self.pending:
                    self._maybe_form(time.monotonic())

    def report_failure(self, msg: dict[str, Any]) -> None:
        with self.lock:
            qid = _int(msg, "quorum_id", 0)
            self.event("failure_reported", group=msg.get("group"), rank=msg.get("rank"), quorum_id=qid,
                       error=str(msg.get("error", ""))[:200])
            self.reports.setdefault(qid, time.monotonic())
            if self.quorum is not None and qid == self.quorum["quorum_id"]:
                self.force_new = True  # the reporter's process group is broken: rebuild everyone's
            self._last_sweep = 0.0     # probe at the next tick

    def leave(self, msg: dict[str, Any]) -> None:
        with self.lock:
            grp = self.groups.get(_int(msg, "group", hi=MAX_GROUPS))
            if grp is None or grp.incarnation != _int(msg, "incarnation", 0):
                return
            rank = grp.ranks.pop(_int(msg, "rank", hi=MAX_WORLD), None)
            if rank is not None:
                self.finished_step = max(self.finished_step, rank.step)
            grp.leaving = True   # its other ranks leave next: not a failure
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
                "quorum": dict(self.quorum) if self.quorum else None,
                "groups": [
                    {"group": g.group, "incarnation": g.incarnation, "healthy": g.healthy, "left": g.left,
                     "step": g.step, "ranks": len(g.ranks), "world": g.world,
                     "standby_s": round(max(self.excluded[g.group] - now, 0.0), 2) if g.group in self.excluded else None,
                     "last_beat_age_s": max((now - r.last_beat for r in g.ranks.values()), default=None)}
                    for g in sorted(self.groups.values(), key=lambda g: g.group)
                ],
            }


class Lighthouse:
    """The control plane of every job that reports to it (one `Job` each, by job id)."""

    def __init__(self, cfg: LighthouseConfig):
        self.cfg = cfg
        self.epoch = secrets.token_hex(4)  # distinguishes store prefixes across lighthouse restarts
        self._jobs_lock = threading.Lock()
        self.jobs: dict[str, Job] = {}
        self._events_lock = threading.Lock()
        self.events: collections.deque = collections.deque(maxlen=2000)
        self.started = time.time()
        self._events_file = open(cfg.events_file, "a") if cfg.events_file else None
        self._stop = threading.Event()
        self._pause_lock = threading.Lock()
        self.alive_at = time.monotonic()      # the last time this process was seen running
        self.grace_until = 0.0                # after a pause: silence is not judged before this
        self._ticker = threading.Thread(target=self._tick, daemon=True, name="lighthouse-tick")
        self._ticker.start()
        self.event("lighthouse_started", epoch=self.epoch, min_replicas=cfg.min_replicas)

    def event(self, kind: str, **data: Any) -> None:
        ev = {"t": time.time(), "kind": kind, **data}
        line = json.dumps(ev)
        with self._events_lock:
            self.events.append(ev)
            print(line, flush=True)
            if self._events_file:
                self._events_file.write(line + "\n")
                self._events_file.flush()

    def job(self, msg: dict[str, Any], create: bool = True) -> Job | None:
        """The job a message belongs to (created on its first registration)."""
        name = job_id(msg)
        with self._jobs_lock:
            j = self.jobs.get(name)
            if j is None and create:
                if len(self.jobs) >= MAX_JOBS:
                    raise ValueError(f"this lighthouse already serves {MAX_JOBS} jobs")
                num_groups = _int(msg, "num_groups", 0, hi=MAX_GROUPS)
                rank_fields(msg, num_groups)   # a bad first message creates no job
                j = self.jobs[name] = Job(self, name, num_groups, _int(msg, "min_replicas", 1, hi=MAX_GROUPS))
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
                except Exception as e:   # never let one job's bad state end every job's rounds
                    self.event("tick_error", job=j.name, error=f"{type(e).__name__}: {e}"[:300])

    # ---- messages for a job that may not exist (never created by them) ----------------------
    def report_failure(self, msg: dict[str, Any]) -> None:
        j = self.job(msg, create=False)
        if j is not None:
            j.report_failure(msg)

    def leave(self, msg: dict[str, Any]) -> None:
        j = self.job(msg, create=False)
        if j is not None:
            j.leave(msg)

    def client_event(self, msg: dict[str, Any]) -> None:
        kind = str(msg.pop("kind", "event"))[:64]
        job = job_id(msg)
        self.event(kind, **{k: v for k, v in msg.items()
                            if k not in ("t", "kind", "job") and isinstance(v, (int, float, str, list))}, job=job)

    def status(self, job: str = DEFAULT_JOB) -> dict[str, Any]:
        j = self.jobs.get(job)
        st = j.status() if j else {"job": job, "min_replicas": self.cfg.min_replicas, "max_step": 0,
                                   "quorum": None, "groups": []}
        with self._events_lock:
            events = [e for e in self.events if e.get("job", job) == job][-100:]
        return {"epoch": self.epoch, "uptime_s": time.time() - self.started, "jobs": sorted(self.jobs),
                **st, "events": events}

    def close(self) -> None:
        self._stop.set()


def _status_html(st: dict[str, Any]) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(str(g['group']))}</td><td>{e(str(g['incarnation']))}</td>"
        f"<td>{'standby (slow)' if g.get('standby_s') else 'yes' if g['healthy'] else 'no'}</td>"
        f"<td>{e(str(g['step']))}</td><td>{e(str(g['ranks']))}/{e(str(g['world']))}</td></tr>" for g in st["groups"])
    q = st["quorum"] or {}
    evs = "".join(f"<li>{time.strftime('%H:%M:%S', time.localtime(float(ev.get('t', 0))))} "
                  f"{e(json.dumps(ev))}</li>" for ev in reversed(st["events"][-30:]))
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
MAX_BODY = 1 << 20            # bytes: larger bodies get 413
MAX_HEADERS = 64
MAX_HEAD = 16 << 10           # bytes of request line and headers
FIRST_REQUEST_S = 10.0        # a new connection must send its first request within this
IDLE_S = 600.0                # a quiet connection that is not a rank's heartbeat line is closed after this
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 409: "Conflict",
           410: "Gone", 413: "Payload Too Large", 431: "Request Header Fields Too Large", 504: "Gateway Timeout"}


class _BadRequest(Exception):
    def __init__(self, code: int, msg: str):
        super().__init__(msg)
        self.code = code


def _response(code: int, body: Any, ctype: str = "application/json") -> bytes:
    """`body`: an object to encode as JSON, or text already encoded (a quorum reply, HTML)."""
    raw = (body if isinstance(body, str) else json.dumps(body)).encode()
    head = (f"HTTP/1.1 {code} {REASONS.get(code, 'Error')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n")
    return head.encode() + raw   # one write: no Nagle wait between headers and body


class _Connection(asyncio.Protocol):
    """One client connection: requests parsed from the byte stream as they arrive, answered in
    order (a quorum request's answer is written when its round forms). No task, no thread."""

    def __init__(self, server: "LighthouseServer"):
        self.srv = server
        self.buf = bytearray()
        self.busy = False           # a request is being answered: later bytes wait (no reordering)
        self.beat: tuple[Job, int, int, int] | None = None   # this connection's heartbeating rank
        self.waiting: tuple[Job, Request] | None = None        # its pending quorum request
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
        body = bytes(self.buf[end + 4:end + 4 + n])
        del self.buf[:end + 4 + n]
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
                self.loop.create_server(lambda: _Connection(self), host, port, backlog=1024))
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
            if c.beat is None and not c.busy and (
                    (c.served == 0 and now - c.opened > FIRST_REQUEST_S) or now - c.last > IDLE_S):
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

    def server_close(self) -> None:
        pass

    def dispatch(self, conn: _Connection, method: str, target: str, headers: dict[str, str], raw: bytes) -> None:
        url = urllib.parse.urlparse(target)
        # header only: a token in a URL ends up in logs, histories and Referer headers
        if not auth.allowed(self.lh.cfg.token, headers.get("authorization")):
            return conn.reply(401, {"error": "missing or wrong token"})
        lh = self.lh
        try:
            if method == "GET":
                job = job_id({"job": urllib.parse.parse_qs(url.query).get("job", [DEFAULT_JOB])[0]})
                if url.path == "/status":
                    return conn.reply(200, lh.status(job))
                if url.path in ("/", "/index.html"):
                    return conn.reply(200, _status_html(lh.status(job)), "text/html; charset=utf-8")
                return conn.reply(404, {"error": f"no such path {url.path}"})
            if method != "POST":
                return conn.reply(404, {"error": f"no {method} here"})
            msg = json.loads(raw.decode("utf-8") or "{}", parse_constant=_no_constant)
            if not isinstance(msg, dict):
                raise ValueError("the body must be a JSON object")
            path = url.path
            if path == "/heartbeat":
                job = lh.job(msg)
                reply = job.heartbeat(msg)   # validates: only then is this connection a rank's
                conn.beat = (job, int(msg["group"]), int(msg["rank"]), int(msg.get("incarnation", 0)))
                return conn.reply(200, reply)
            if path == "/register":
                lh.job(msg).register(msg)
                return conn.reply(200, {"epoch": lh.epoch})
            if path == "/quorum":
                return self._quorum(conn, lh.job(msg), msg)
            if path == "/report_failure":
                lh.report_failure(msg)
            elif path == "/leave":
                lh.leave(msg)
                conn.beat = None
            elif path == "/event":
                lh.client_event(msg)
            else:
                return conn.reply(404, {"error": f"no such path {path}"})
            conn.reply(200, {})
        except StaleIncarnation as e:
            conn.beat = None
            conn.reply(409, {"error": str(e)})
        except (KeyError, ValueError, TypeError, UnicodeDecodeError, RecursionError) as e:
            conn.reply(400, {"error": f"bad request: {e!r}"[:500]})

    def _quorum(self, conn: _Connection, job: Job, msg: dict[str, Any]) -> None:
        timeout = float(msg.get("timeout", timeouts.QUORUM_TIMEOUT))
        if not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"timeout={timeout} must be a positive number of seconds")
        loop_thread = threading.get_ident()

        def answer(reply: dict[str, Any] | str) -> None:
            if isinstance(reply, str):
                conn.reply(200, reply)
            else:
                conn.reply(200 if reply.get("standby") or reply.get("overtaken") else 409 if reply.get("error") == "stale incarnation" else
                           410 if reply.get("lost") or reply.get("finished") else 504, reply)

        def deliver(reply: dict[str, Any] | str) -> None:   # under the job's lock: the ticker's thread or this loop's
            if threading.get_ident() == loop_thread:
                self.loop.call_soon(answer, reply)    # after this request's own dispatch has returned
            else:
                self.loop.call_soon_threadsafe(answer, reply)
        conn.waiting = (job, job.enqueue(msg, deliver, min(timeout, timeouts.QUORUM_TIMEOUT)))


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
    p.add_argument("--expected-replicas", type=int, default=0,
                   help="groups the job starts with: the first quorum waits for all of them or the join timeout")
    p.add_argument("--join-timeout", type=float, default=timeouts.JOIN_TIMEOUT)
    p.add_argument("--heartbeat-timeout", type=float, default=timeouts.HEARTBEAT_TIMEOUT)
    p.add_argument("--token-file", help="file holding the shared token (else FTCORE_TOKEN / FTCORE_TOKEN_FILE)")
    p.add_argument("--insecure", action="store_true",
                   help="serve without a token (loopback binds only): anyone who reaches it can steer every job")
    p.add_argument("--events-file", help="append every event to this JSON-lines file")
    p.add_argument("--lease", type=float, default=timeouts.LEASE,
                   help="seconds a group may go on in its last quorum while this lighthouse is silent (0: never)")
    p.add_argument("--no-pause-grace", action="store_true",
                   help="judge heartbeat timeouts at once after this process was paused (for comparison only)")
    pace = PacePolicy()
    p.add_argument("--slow-ratio", type=float, default=pace.ratio,
                   help="fail-slow: exclude a group whose compute is this many times its peers' (0: never; "
                        "FTCORE_SLOW_RATIO)")
    p.add_argument("--slow-window", type=int, default=pace.window,
                   help="... for this many consecutive rounds (FTCORE_SLOW_WINDOW)")
    p.add_argument("--slow-probation", type=float, default=pace.probation_s,
                   help="seconds an excluded group waits before it may rejoin; doubles each time (FTCORE_SLOW_PROBATION)")
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
        print("ftcore.lighthouse: no token; give --token-file, or set FTCORE_TOKEN / FTCORE_TOKEN_FILE "
              "(or --insecure on a loopback --bind for a throwaway run)", file=sys.stderr)
        return 2
    if token is None and not netaddr.is_loopback(a.bind.rpartition(":")[0].strip("[]") or "127.0.0.1"):
        print(f"ftcore.lighthouse: refusing to serve {a.bind} without a token: --insecure is for loopback "
              "binds only; give --token-file", file=sys.stderr)
        return 2
    cfg = LighthouseConfig(a.bind, a.min_replicas, a.expected_replicas, a.join_timeout, a.heartbeat_timeout,
                           token=token, events_file=a.events_file, lease=max(a.lease, 0.0),
                           pause_grace=not a.no_pause_grace, pace=pace)
    try:
        server, lh = serve(cfg)
    except OSError as e:
        print(f"ftcore.lighthouse: cannot listen on {a.bind}: {e.strerror}; choose another --bind", file=sys.stderr)
        return 2
    print(json.dumps({"t": time.time(), "kind": "listening", "address": "%s:%d" % server.server_address[:2]}),
          flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
