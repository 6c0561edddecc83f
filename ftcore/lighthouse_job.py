"""One job on the lighthouse: its replica groups, their health, and its quorum rounds.

Each job has its own lock, so jobs served by one lighthouse never wait on each other. A group
is failed three ways: its heartbeat connection closes (a killed process: milliseconds), it is
not heard within FAILURE_PROBE of a probe (a survivor's data-plane error or stalled exchange,
or a round kept waiting STALL_PROBE on it), or its heartbeats stop for HEARTBEAT_TIMEOUT. A
fast quorum forms as soon as every healthy member of the previous quorum asks; otherwise a
round waits up to JOIN_TIMEOUT."""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ftcore.answers import OvertakenReply, QuorumRefused
from ftcore.lighthouse_config import LighthouseConfig
from ftcore.lighthouse_pulse import Pulse
from ftcore.lighthouse_records import (
    Deliver,
    GroupRecord,
    Health,
    Pending,
    Probe,
    Request,
    StaleIncarnation,
    in_slices,
)
from ftcore.lighthouse_slow import SlowGroups
from ftcore.messages import (
    FailureReport,
    HeartbeatReply,
    Identity,
    Pace,
    Quorum,
    QuorumRequest,
    RankInfo,
    aside_of,
    identity_key,
)
from ftcore.quorum import (
    FormationRound,
    Formed,
    HealPlan,
    Hearing,
    Member,
    arrivals_needed,
    decide,
    isolated,
    plan,
    resumed,
    waited_for,
)

TICK_S = 0.01  # formation rounds: how often a waiting round re-checks its members


class Job:
    """One training job's membership and quorum: groups, pending quorum requests, heals.

    Each job has its own lock, so jobs served by one lighthouse never wait on each other."""

    def __init__(
        self,
        cfg: LighthouseConfig,
        pulse: Pulse,
        log: Callable[..., None],
        name: str,
        num_groups: int,
        min_replicas: int,
    ):
        """`pulse`: the lighthouse's own (pauses, pace, its id); `log`: its event log."""
        self.cfg, self.pulse, self._log, self.name = cfg, pulse, log, name
        self.num_groups = num_groups  # 0: not declared by the ranks (any group id up to MAX_GROUPS)
        self.min_replicas = max(cfg.min_replicas, min_replicas)
        self.expected = num_groups or cfg.expected_replicas
        self.lock = threading.Lock()
        self.groups: dict[int, GroupRecord] = {}
        self.quorum: Quorum | None = None  # the last one formed (its shared part: no rank's addresses)
        self.quorum_id = 0
        self.lease_until = 0.0  # monotonic: no member of self.quorum leases on it after this
        self.max_step = 0
        self.round = Pending()
        self.health = Health()
        self.finished_step = 0  # the highest step a group that finished (left) reached
        self.slow = SlowGroups(cfg.pace, self.event)  # fail-slow: its judge and the groups on standby
        self.events: collections.deque = collections.deque(maxlen=cfg.events_per_job)
        self.created = self.last_heard = time.monotonic()  # its first message; the last of any of its ranks
        self.relay: bool | None = None  # its groups speak through relays (ftcore/relay.py); None: no group yet
        self.ranks_held = 0  # the ranks its groups' incarnations registered (each group's world, summed)
        self.leader = -1  # the member whose ranks host the current quorum's rendezvous (Job._leader)

    def event(self, kind: str, **data: Any) -> None:
        self._log(kind, job=self.name, **data)

    # ---- membership ---------------------------------------------------------------
    def _rank(self, info: RankInfo, new_line: bool = False) -> GroupRecord:
        """Find or register the sender of `info` (checked by RankInfo.parse), and record what it
        says; `new_line`: it says so on a heartbeat line of its own (Job.heartbeat). Its group.

        Everything is checked before anything changes: a bad message is a 400, never state."""
        g, world, r, inc, step = info.group, info.world, info.rank, info.incarnation, info.step
        if self.num_groups and g >= self.num_groups:
            raise ValueError(f"group={g} is outside [0, {self.num_groups})")
        grp = self.groups.get(g)
        if grp is not None and inc < grp.incarnation:
            raise StaleIncarnation(f"group {g} incarnation {inc} was replaced by {grp.incarnation}")
        if grp is not None and inc == grp.incarnation and world != grp.world:
            raise ValueError(f"group {g} incarnation {inc} has {grp.world} ranks, this rank says {world}")
        new = grp is None or inc > grp.incarnation
        held = self.ranks_held - (grp.world if grp is not None and new else 0) + (world if new else 0)
        if held > self.cfg.max_ranks_per_job:  # one job's token cannot fill the lighthouse's memory
            raise ValueError(
                f"job {self.name} would hold {held} ranks with group {g}'s {world}: over this lighthouse's "
                f"--max-ranks-per-job {self.cfg.max_ranks_per_job}"
            )
        if self.relay is not None and self.relay != info.relay:
            # a quorum's replies hand rank k the addresses of rank k: one layout per job
            raise ValueError(f"job {self.name}: some groups speak through a relay and some do not (FTCORE_RELAY)")
        if not self.num_groups and info.num_groups:  # a job first seen without its size learns it
            self.num_groups = info.num_groups
            self.expected = self.expected or self.num_groups
        if grp is None or inc > grp.incarnation:  # new
            self.ranks_held = held
            if grp is not None:
                self._drop_pending(g)
                self.slow.judge.readmit(g)  # a restarted group starts up again: measured once settled
            grp = self.groups[g] = GroupRecord(g, inc, world, relay=info.relay)
            self.relay = info.relay
            self.health.healthy.discard(g)  # a new incarnation is healthy once the sweep says so
            relayed = {"relay": True} if info.relay else {}
            self.event("register", group=g, incarnation=inc, world=world, step=step, **relayed)
        grp.left = False
        self.last_heard = time.monotonic()
        if grp.beat(r, info.store, info.heal, step, self.last_heard, new_line):  # its line had closed
            self.health.sweep_asked = True
        self.max_step = max(self.max_step, grp.rank_step(r))
        self.quorum_id = max(self.quorum_id, info.quorum_id)  # after a restart: above any seen
        return grp

    def _drop_pending(self, g: int) -> None:
        for req in self._pop(g).values():
            req.deliver(QuorumRefused("stale", "stale incarnation"))

    def _is_healthy(self, grp: GroupRecord, now: float, cut: float, members: set[int], silence: bool) -> bool:
        """`cut`: the current quorum's last failure probe that ended (FailureReport); `members`:
        its groups; `silence`: whether silence counts now (the sweep's, computed once)."""
        if grp.left or grp.registered < grp.speakers:
            return False
        # past the probe after a failure report, a member not heard since the report has failed,
        # and stays failed (out of the quorum too) until it is heard again
        cut, quiet = max(cut if grp.group in members else -math.inf, grp.probed), self.cfg.heartbeat_timeout
        quiet = quiet if silence else math.inf
        if not grp.heard_within(now, quiet, cut):
            grp.probed = cut
            return False
        return True

    def _silence_counts(self, now: float) -> bool:
        """Whether a rank's silence is evidence against it: not while this lighthouse was paused
        or seems cut off, nor for a heartbeat timeout after (it heard nobody: not their fault)."""
        return not (self._in_grace(now) or self.health.isolated)

    def _in_grace(self, now: float) -> bool:
        """Just after this lighthouse was paused or cut off: nobody is judged by a silence yet."""
        return self.pulse.in_grace(now) or now < self.health.grace_until

    def _hearing(self, since: float, probes: Iterable[Probe]) -> Hearing:
        """What this lighthouse heard since `since` (quorum.Hearing): of the healthy complete
        groups, those silent since then, and whether a group heard since began one of `probes`."""
        live = [g for g in in_slices(self.groups, self.lock) if g.healthy and not g.left and g.registered == g.speakers]
        heard = {g.group for g in live if not g.silent_since(since)}
        accused = any(p.t >= since and p.by & heard for p in probes)
        return Hearing(len(live), len(live) - len(heard), accused)

    def _notice_isolation(self, now: float) -> None:
        """Most groups silent at once, none of them gone, and nobody heard accuses them: the one
        cut off is most likely this lighthouse (ftcore/quorum.py, `isolated`). It holds its
        verdicts while that lasts, and grants everyone a heartbeat timeout to be heard once they
        speak again (not when an accusation ends it: the accused are failed on that evidence)."""
        # half a timeout quiet counts: groups cut off together go silent within an interval of each other
        probes = self.health.reports.get(self.quorum.quorum_id, []) if self.quorum else []
        hearing = self._hearing(now - self.cfg.heartbeat_timeout / 2, probes)
        cut_off = isolated(hearing)
        if cut_off != self.health.isolated:
            self.health.isolated = cut_off
            if cut_off:
                self.event("lighthouse_isolated", silent=hearing.silent, groups=hearing.live)
            elif hearing.accused:
                self.event("lighthouse_not_isolated", reason="a group it hears reports the silent ones stalled")
            else:
                self.health.grace_until = now + self.cfg.heartbeat_timeout
                self.event("lighthouse_reconnected", grace_s=self.cfg.heartbeat_timeout)

    def _update_health(self, now: float) -> None:
        """O(ranks), on the ticker (never on the loop that answers every job), under the job's
        lock, let go between slices of groups (lighthouse_records.in_slices): Health.sweep_due."""
        t0 = time.perf_counter()
        self.pulse.notice_pause(now)
        self._sweep(self.pulse.judged_at(now))
        self.health.swept(now, time.perf_counter() - t0)

    def _sweep(self, now: float) -> None:
        """The health of every group as of `now` (the moment silence is judged at)."""
        if not self.pulse.in_grace(now):  # after its own pause, this lighthouse knows why it heard nobody
            self._notice_isolation(now)
        probes = self.health.reports.get(self.quorum.quorum_id, []) if self.quorum else []
        # a probe that ends having heard most groups not at all, its accusers among them, says more
        # about this lighthouse than about them: it is dropped (its verdict would otherwise fall on
        # the last to be heard again). Its accusers heard, the silent ones fail, however many.
        end = self.pulse.probe_s
        # (judged on a copy: a big job's sweep lets its lock go, and a report may add a probe meanwhile)
        dropped = [p for p in list(probes) if now > p.t + end and isolated(self._hearing(p.t, (p,)))]
        probes[:] = [p for p in probes if p not in dropped]
        cut = max((p.t for p in probes if now > p.t + end), default=-math.inf)
        members, silence = set(self.quorum.groups if self.quorum else ()), self._silence_counts(now)
        for grp in in_slices(self.groups, self.lock):
            ok = self._is_healthy(grp, now, cut, members, silence)
            if ok != grp.healthy:
                grp.healthy = ok
                (self.health.healthy.add if ok else self.health.healthy.discard)(grp.group)
                if ok:
                    self.event("group_healthy", group=grp.group, incarnation=grp.incarnation, step=grp.step)
                elif not (grp.left or grp.leaving):
                    why = grp.why_failed(now, self.cfg.heartbeat_timeout)
                    self.event("failure_detected", group=grp.group, incarnation=grp.incarnation, reason=why)
        self.health.failed = [
            g for g in (self.quorum.groups if self.quorum else ()) if g in self.groups and not self.groups[g].healthy
        ]
        self._refresh_need()

    def _refresh_need(self) -> None:
        """After the health or the quorum changed: what arrivals must reach (quorum.arrivals_needed)."""
        previous = frozenset(self.quorum.groups) if self.quorum else None
        healthy = frozenset(self.health.healthy - self.slow.excluded.keys())
        self.round.need = arrivals_needed(previous, healthy, self.expected, self.min_replicas)

    # ---- quorum ---------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if self.health.sweep_due(now):
            self._update_health(now)
        self._probe_stalled_round(now)
        if self.round.pending and self._worth_trying(now):
            self._maybe_form(now)
        if now >= self.round.deadline:
            self._expire(now)

    def _probe_stalled_round(self, now: float) -> None:
        """A round kept waiting `stall_probe` by healthy members of the last quorum that have not
        asked probes the quorum, as a stalled exchange's report does (a partition closes no
        connection): one not heard within the failure probe is failed. Once per round. The
        groups that ask are its accusers: heard, they make it count even when most are silent."""
        q, start = self.quorum, self.round.start
        if q is None or start is None or now - start < self.cfg.stall_probe or self._in_grace(now):
            return
        missing = sorted(set(q.groups) & self.health.healthy - self.slow.excluded.keys() - self.round.pending.keys())
        if missing and self.round.probed < start:
            probes, self.round.probed = self.health.probes(q.quorum_id, q.quorum_id), now
            probes[:] = [*probes[-1:], Probe(now, frozenset(self.round.pending))]
            self.event("round_stalled", waiting_for=missing, quorum_id=q.quorum_id, seconds=round(now - start, 3))

    def _worth_trying(self, now: float) -> bool:
        """Whether a tick's formation attempt can do anything an arrival's did not: enough groups
        complete, the join timeout reached, or a pending group unhealthy (lost: told to exit)."""
        waited = self.round.start is not None and self._waited(now, self.round.start)
        unhealthy = not self.round.pending.keys() <= self.health.healthy
        # before a first quorum here, a majority may resume the quorum they last trained in
        resuming = self.quorum is None and 2 * len(self.round.complete) > len(self.health.healthy)
        return len(self.round.complete) >= self.round.need or waited or unhealthy or resuming

    def _waited(self, now: float, since: float) -> bool:
        """Whether a round waiting since `since` may form without the groups it lacks: after the
        join timeout; but a job's first quorum, while a group it expects has not spoken at all
        (its processes still start), only after the start timeout from the job's first message;
        and after a restart of this lighthouse only once the lease of the quorum it forgot has
        run out (its members may train on in it, unseen: quorum.decide's rule, from memory lost)."""
        if now - since < self.cfg.join_timeout:
            return False
        if self.quorum is not None or self.finished_step or now - self.created >= self.cfg.start_timeout:
            return True
        resumed = any(r.last_quorum for g in self.round.pending.values() for r in g.values())  # a restarted lighthouse
        if resumed:
            return now - self.created >= self.cfg.lease
        return len(self.groups) >= self.expected

    def _expire(self, now: float) -> None:
        """Answer the requests whose deadline passed (O(pending), only when one has)."""
        for g in list(self.round.pending):
            for r, req in list(self.round.pending[g].items()):
                if now >= req.deadline:
                    del self.round.pending[g][r]
                    self.round.complete.discard(g)
                    req.deliver(QuorumRefused("timeout", "timeout waiting for a quorum"))
            if not self.round.pending[g]:
                del self.round.pending[g]
        self._restart_round()

    def _drop_overtaken(self, now: float) -> None:
        """Just after this lighthouse heard nobody (a pause, a partition), a behind member of the
        unchanged quorum is taken as a leased request (enqueue): sent before its group went on
        under the lease, it arrives late (TCP backoff), and once a peer asks for a later step it
        leaves the round (forming it would heal the group "up" to a step it reaches anyway); one
        that really fell behind heals after the grace."""
        if len(self.round.pending) < 2:
            return
        top = max(r.step for rs in self.round.pending.values() for r in rs.values())
        members = set(self.quorum.identity) if self.quorum is not None and not self._silence_counts(now) else set()
        for g, rs in list(self.round.pending.items()):
            late = all(r.step < top and (g, r.incarnation) in members for r in rs.values())
            if late:
                for req in self._pop(g).values():
                    req.deliver(OvertakenReply(top))

    def _maybe_form(self, now: float) -> None:
        """O(groups): one formation attempt on the health of the last sweep."""
        self._drop_overtaken(now)
        for g in list(self.round.pending.keys() - self.health.healthy):
            # a group that lost a rank cannot train: its survivors exit now (and restart whole)
            silence = self.cfg.heartbeat_timeout if self._silence_counts(now) else None
            lost = self.groups[g].lost_rank(now, self.cfg.failure_probe, silence)
            if lost is not None:
                self._refuse([g], "lost", f"replica group {g} lost rank {lost}; restart the group")
        if not self.round.pending:
            return
        # a group on standby is not waited for, nor counted
        healthy = frozenset(self.health.healthy - self.slow.excluded.keys())
        round_start = self.round.start if self.round.start is not None else now
        requesting = sorted(self.round.complete & healthy)
        decision = decide(
            FormationRound(
                previous=self._previous(),
                requesting=frozenset(requesting),
                healthy=healthy,
                min_replicas=self.min_replicas,
                expected=self.expected,
                # a round does not time out on members this lighthouse cannot hear (isolated, paused)
                waited=self._waited(now, round_start) and self._silence_counts(now),
                leasing=self._leasing(now),
                resumes=self.quorum is None and self._resumed(requesting) is not None,
            )
        )
        if isinstance(decision, Formed):
            self._form(list(decision.members))
        elif now - round_start > 1.0 and now - self.round.last_wait_event > 1.0:
            self.round.last_wait_event = now  # say why a round is stuck (status page, timeline)
            self.event(
                "quorum_waiting",
                reason=decision.reason,
                requesting=sorted(self.round.complete & healthy),
                healthy=sorted(healthy),
                pending={str(g): sorted(r) for g, r in self.round.pending.items()},
                previous=list(self.quorum.groups) if self.quorum else None,
                seconds=round(now - round_start, 2),
            )

    def _leasing(self, now: float) -> frozenset[int]:
        """Members of the last quorum that may still commit in it on its lease (manager: from
        before their request, so within `lease_until`): not replaced, left or crashed."""
        q = self.quorum
        if q is None or now >= self.lease_until:
            return frozenset()
        return frozenset(g for g, inc in q.identity if (grp := self.groups.get(g)) is not None and grp.standing(inc))

    def _previous(self) -> frozenset[int] | None:
        """quorum.waited_for over the last quorum and the round's requests: O(their ranks)."""
        if (q := self.quorum) is None:
            return None
        asked = ((g, r.last_quorum, r.step) for g, rs in self.round.pending.items() for r in rs.values())
        return waited_for(q.groups, q.heal, q.quorum_id, q.max_step, asked)

    def _resumed(self, members: list[int]) -> tuple[int, str, bool] | None:
        """quorum.resumed over the members' requests: O(their ranks), O(1) at a job's start."""
        identity = tuple((g, self.groups[g].incarnation) for g in members)
        reqs = (r for g in members for r in self.round.pending[g].values())
        last = ((r.last_quorum, r.last_lighthouse_id, r.last_key, r.last_settled) for r in reqs)
        return resumed(last, identity_key(identity))

    def _form(self, members: list[int]) -> None:
        """Build the whole quorum and every rank's reply first, then change state."""
        where = self._plan(members)
        if where is None:
            why = f"the job finished at step {self.finished_step}; nothing to rejoin"
            return self._refuse(members, "finished", why)
        identity, quorum_id, lighthouse_id, settled = self._name(members, where.heal)
        busy = self.slow.figures(self.quorum, self.round.pending, self.groups, members)
        idle = self.quorum is not None and all(
            r.idle == self.quorum.quorum_id for g in members for r in self.round.pending[g].values()
        )
        q = Quorum(
            quorum_id=quorum_id,
            lighthouse_id=lighthouse_id,
            job=self.name,
            identity=identity,
            groups=tuple(members),
            max_step=where.max_step,
            heal=where.heal,
            lease_s=self.cfg.lease,
            # the members' compute in the step they just finished: each sees its wait for the slowest
            pace=Pace(self.quorum.quorum_id, round(max(busy.values()), 6), round(sum(busy.values()) / len(busy), 6))
            if busy and self.quorum
            else None,
            settled=settled,
        )
        leader = self._leader(q)
        replies = self._replies(q, leader)
        changed = self.quorum is None or self.quorum.key != q.key
        self.quorum, self.quorum_id, self.leader, self.health.force_new = q, quorum_id, leader, False
        self.lease_until = time.monotonic() + q.lease_s  # the members' leases run from before they asked
        self.max_step = max(self.max_step, where.max_step)
        self.health.failed = []
        self._refresh_need()
        for g in members:
            del self.round.pending[g]
        self.round.complete -= set(members)
        self._restart_round()
        for req, reply in replies:
            req.deliver(reply)
        if changed:
            extra = {"settled": True} if q.settled else {}  # the heal quorum's members, its heals done
            heal = q.shared()["heal"]
            self.event("quorum_formed", quorum_id=quorum_id, groups=members, max_step=q.max_step, heal=heal, **extra)
        for g in where.heal:
            self.event("heal_assigned", group=g, source=q.heal[g], step=q.max_step, quorum_id=quorum_id)
        if idle and self.slow.excluded:  # the work left is the excluded groups' own: let them do it
            self.slow.release()
        self.slow.exclude_slow(members, {g: self.groups[g].incarnation for g in members}, self.min_replicas)

    def _name(self, members: list[int], heal: dict[int, int]) -> tuple[Identity, int, str, bool]:
        """The quorum's identity, ids and whether it is settled: the current ones while its
        membership and its members aside (so its exchange's process group) hold; once a heal
        quorum's heals are done, the same members settled (Quorum.settle), which is where a
        member that missed this answer goes on under its lease: one rendezvous for both; new
        ones when the members changed or a failure forces them; the resumed ones after a restart."""
        identity = tuple((g, self.groups[g].incarnation) for g in members)
        again = self._resumed(members) if self.quorum is None and not self.health.force_new else None
        if again is not None:
            return identity, *again
        q, aside = self.quorum, aside_of(members, heal)
        if q is not None and q.identity == identity and not self.health.force_new:
            if q.aside() == aside:
                return identity, self.quorum_id, q.lighthouse_id, q.settled
            if q.aside() and not heal:
                return identity, self.quorum_id, q.lighthouse_id, True
        return identity, self.quorum_id + 1, self.pulse.lighthouse_id, False

    def _leader(self, q: Quorum) -> int:
        """The member whose rank k hosts rank k's rendezvous: the exchange's first; a settled
        quorum's stays that of the heal quorum it settles, as a lease settles it (Quorum.settle)."""
        prev = self.quorum
        if not q.settled or prev is None or prev.key[:2] != q.key[:2]:
            return q.exchange()[0]
        return self.leader if prev.settled else prev.exchange()[0]

    def _plan(self, members: list[int]) -> HealPlan | None:
        """Where the members meet (quorum.plan); None: training ended (a group finished at a
        later step and left) beyond any state here: no new history from an older one."""
        return plan(
            frozenset(self.quorum.identity) if self.quorum is not None else None,
            [
                Member(
                    g,
                    self.groups[g].incarnation,
                    min(req.step for req in self.round.pending[g].values()),
                    min(req.last_quorum for req in self.round.pending[g].values()),
                )
                for g in members
            ],
            self.finished_step,
        )

    def _refuse(self, groups: list[int], reason: str, error: str) -> None:
        for g in groups:
            for req in self._pop(g).values():
                req.deliver(QuorumRefused(reason, error))

    def _replies(self, q: Quorum, leader: int) -> list[tuple[Request, str]]:
        """Every member rank's reply. Each rank k gets only the addresses it uses: rank k of the
        exchange's first member (`leader`, Job._leader) hosts the rendezvous of every rank k and
        serves the step's average to the members aside, and a healing rank k fetches from rank k
        of its source. The shared part is encoded once per round, and each distinct reply once."""
        lead, aside = self.groups[leader], q.aside()
        shared = q.shared_json()
        replies = []
        made: dict[tuple[str, str, str], str] = {}
        for g in q.groups:
            src = self.groups[q.heal[g]] if g in q.heal else None
            for req in self.round.pending[g].values():
                k = req.rank
                store = lead.store(k) if lead.has(k) else ""
                heal_from = src.heal(k) if src is not None and src.has(k) else ""
                update_from = lead.heal(k) if lead.has(k) and g in aside else ""
                reply = made.get((store, heal_from, update_from))
                if reply is None:
                    reply = made[store, heal_from, update_from] = Quorum.for_rank(shared, store, heal_from, update_from)
                replies.append((req, reply))
                if self.groups[g].has(k):
                    self.groups[g].answer(k, (req.step, q.quorum_id, reply))
        return replies

    def _answered_again(self, grp: GroupRecord, ask: QuorumRequest) -> str | None:
        """The answer a rank was given for this step in the current quorum, when it says it did
        not apply it (`again`: lost with its connection, or its round given up) and nothing
        failed since: the quorum that counts it stands, and its peers wait for it there."""
        a = grp.answered(ask.info.rank)
        if not ask.again or a is None or self.quorum is None or self.health.force_new:
            return None
        if (ask.info.step, self.quorum.quorum_id) != a[:2]:
            return None
        self.lease_until = max(self.lease_until, time.monotonic() + self.quorum.lease_s)
        return a[2]

    def enqueue(self, ask: QuorumRequest, deliver: Deliver, timeout: float) -> Request:
        """A rank's quorum request joins this round; `deliver` gets the reply when it forms
        (maybe at once: this arrival may complete the round; the ticker does the rest), or a
        timeout error after `timeout` seconds."""
        with self.lock:
            grp = self._rank(ask.info)
            now = time.monotonic()
            req = Request.of(ask, grp.incarnation, now, deliver, timeout)
            standby = self.slow.standby(grp, now, bool(self.finished_step))
            if standby is not None:
                deliver(standby)
                return req
            if ask.leased:  # its step went on without this lighthouse: a round of it would be a phantom
                deliver(OvertakenReply(ask.info.step))  # its sender asks again where it is now
                return req
            again = self._answered_again(grp, ask)
            if again is not None:
                deliver(again)
                return req
            self.round.deadline = min(self.round.deadline, req.deadline)
            reqs = self.round.pending.setdefault(grp.group, {})
            old = reqs.get(req.rank)
            if old is not None:  # the same rank asking again (a retry): the earlier waiter is gone
                old.deliver(QuorumRefused("superseded", "superseded by a newer request"))
            reqs[req.rank] = req
            if self.round.start is None:
                self.round.start = now
            if len(reqs) == grp.speakers:  # O(groups) formation only when a group is complete
                self.round.complete.add(grp.group)
                if not grp.healthy:  # a new or returning group: swept, then formed, at the next tick
                    self.health.sweep_asked = True
                elif len(self.round.complete) >= self.round.need:
                    self._maybe_form(now)
            return req

    def withdraw(self, req: Request) -> None:
        """A request whose waiter gave up (timeout) leaves the round."""
        with self.lock:
            reqs = self.round.pending.get(req.group, {})
            if reqs.get(req.rank) is req:
                del reqs[req.rank]
                self.round.complete.discard(req.group)
                if not reqs:
                    del self.round.pending[req.group]
                self._restart_round()

    def _pop(self, g: int) -> dict[int, Request]:
        reqs = self.round.pending.pop(g, {})
        self.round.complete.discard(g)
        self._restart_round()
        return reqs

    def _restart_round(self) -> None:
        """O(pending): after requests leave the round (formation, timeouts, failures)."""
        reqs = [r for rs in self.round.pending.values() for r in rs.values()]
        self.round.start = min((r.t for r in reqs), default=None)
        self.round.deadline = min((r.deadline for r in reqs), default=math.inf)

    # ---- other requests -------------------------------------------------------------
    def heartbeat(self, info: RankInfo, new_line: bool = False) -> HeartbeatReply:
        """O(1): the failed list is the last sweep's. `new_line`: the first heartbeat on its
        connection (a rank may open another while one stalls, lighthouse_client.py)."""
        with self.lock:
            self._rank(info, new_line)
            qid = self.quorum.quorum_id if self.quorum else 0
            abandoned = self.health.force_new and self.quorum is not None
            return HeartbeatReply(qid, tuple(self.health.failed), beat_s=self.pulse.beat_s, abandoned=abandoned)

    def disconnected(self, g: int, r: int, inc: int) -> None:
        """One of the rank's heartbeat connections closed: it is gone once none is left."""
        with self.lock:
            grp = self.groups.get(g)
            if grp is not None and grp.incarnation == inc and grp.has(r) and not grp.left:
                if grp.line_closed(r, time.monotonic()):
                    self.health.sweep_asked = True  # the ticker fails it, then forms without it

    def report_failure(self, report: FailureReport) -> None:
        with self.lock:
            qid = report.quorum_id
            kind = "stall_reported" if report.stalled else "failure_reported"
            self.event(kind, group=report.group, rank=report.rank, quorum_id=qid, error=report.error)
            now, probes = time.monotonic(), self.health.probes(qid, self.quorum.quorum_id if self.quorum else None)
            if not probes or now > probes[-1].t + self.pulse.probe_s:  # a new probe (a quorum outlives a stall)
                # the last one ended stands until this one ends
                probes[:] = [*probes[-1:], Probe(now, frozenset({report.group}))]
            # the reporter's process group is broken: rebuild everyone's (after a restart of this
            # lighthouse too: the quorum its members report is not resumed as it was)
            if not report.stalled and (self.quorum is None or qid == self.quorum.quorum_id):
                self.health.force_new = True
            self.health.sweep_asked = True  # probe at the next tick

    def leave(self, info: RankInfo) -> None:
        with self.lock:
            grp = self.groups.get(info.group)
            if grp is None or grp.incarnation != info.incarnation:
                return
            step = grp.drop(info.rank)
            if step is not None:  # its goodbye carries its last step: no beat may have since it committed
                self.finished_step = max(self.finished_step, step, info.step)
            grp.leaving = True  # its other ranks leave next: not a failure
            if not grp.registered and not grp.left:
                grp.left = True
                grp.healthy = False
                self.health.healthy.discard(grp.group)
                self.event("group_left", group=grp.group, incarnation=grp.incarnation)

    # ---- lifetime -----------------------------------------------------------------------
    def retirement(self, now: float, idle_s: float) -> str | None:
        """Why this job may be retired now ("finished", "idle"), or None. Under the job's lock."""
        if self.round.pending or not self._silence_counts(now):
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
