"""The manager: FT-HSDP's step protocol in one rank of one replica group, a transaction that
commits on every group or on none: `start_quorum()` asks the lighthouse in the background,
`allreduce()` averages across groups (FTAR; a healing group and its source stand aside and
fetch the average, or, with nobody else left, the healer sends zeros), `should_commit()`
is the group's vote (a healing group loads its state there). A failed quorum, exchange or heal
fails the step, never the process; while the lighthouse is silent a committed group goes on
in its last quorum on a lease (timeouts.LEASE); data-plane errors are reported at once."""

import json
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from ftcore import aside, netaddr, timeouts
from ftcore import collectives as coll
from ftcore.crossgroup import CrossGroup
from ftcore.faults import Fault, InjectedFault, Injector
from ftcore.ftar import FTARError, FTARResult, ftar
from ftcore.heal import HealError, HealServer, fetch
from ftcore.lighthouse_client import LighthouseClient, LighthouseError, LighthouseHandle, Overtaken, Replaced, Standby
from ftcore.manager_config import LR_POLICIES, ManagerConfig, config_from_env, faults_from_env
from ftcore.messages import MAX_ADDRESS, Busy, Quorum, QuorumRequest, RankInfo
from ftcore.relay import Relay

__all__ = ["Manager", "ManagerConfig", "StepRecord", "config_from_env", "faults_from_env"]

# makes this rank's lighthouse client: (lighthouse host:port, what the rank reports, token)
ClientFactory = Callable[[str, RankInfo, str | None], LighthouseHandle]


def agree_incarnation(group_pg: dist.ProcessGroup | None) -> int:
    """A new incarnation number that every rank of the group shares: rank 0's clock in
    milliseconds, broadcast over the group. It grows across restarts by any scheduler (a
    restart takes longer than the clock's error between two starts of rank 0)."""
    t = torch.tensor([time.time_ns() // 1_000_000], dtype=torch.int64)
    if group_pg is not None and coll.get(group_pg).size() > 1:
        coll.broadcast(t, 0, kind=coll.CONTROL, group=group_pg)
    return int(t.item())


def _relay(cfg: ManagerConfig, info: RankInfo, group_pg: dist.ProcessGroup | None) -> tuple[Relay | None, str]:
    """Where this rank's lighthouse client speaks: its group's relay, which rank 0 starts
    (a group of several ranks with its own process group), or the lighthouse itself."""
    if not (cfg.relay and cfg.world > 1 and group_pg is not None):
        return None, cfg.lighthouse
    relay = Relay(cfg.lighthouse, info, cfg.token, cfg.host) if cfg.rank == 0 else None
    raw = torch.zeros(MAX_ADDRESS, dtype=torch.int64)
    if relay is not None:
        addr = relay.address.encode()
        raw[: len(addr)] = torch.tensor(list(addr), dtype=torch.int64)
    coll.broadcast(raw, 0, kind=coll.CONTROL, group=group_pg)
    return relay, bytes(int(b) for b in raw.tolist() if b).decode()


@dataclass
class StepRecord:
    """One step attempt, as data (the launcher turns these into MLflow metrics/timeline)."""

    step: int
    quorum_id: int
    participants: int
    contributors: int
    healing: bool
    committed: bool
    lr_scale: float
    quorum_s: float
    allreduce_s: float
    t: float
    error: str = ""
    leased: bool = False  # the lighthouse did not answer: the step ran in the previous quorum
    requorum: bool = False  # a peer failed its exchange: it re-ran in the survivors' quorum (same batch)
    idle: bool = False  # nobody had work: no step, and no failure (the data done, waiting for every group)


@dataclass
class Round:
    """One step attempt, made whole by start_quorum: nothing of it is reset by hand. The quorum
    worker holds its round, so an answer that comes after a later round began is known as late."""

    ask: QuorumRequest  # what the round's request reports, fixed at its start
    sent: tuple[Busy | None, float]  # the busy figure it sent, and the previous step's FTAR seconds
    t0: float = field(default_factory=time.monotonic)
    fut: Future | None = None  # the quorum call
    leased: bool = False  # it went on in the previous quorum without the lighthouse's answer
    answered: bool = False  # its answer was taken: it can no longer lease
    answer: Quorum | None = None  # that answer (its exchange's group may yet fail to build)
    stalled: bool = False  # its exchange made no progress for STALL_PROBE (reported)
    waited: bool = False  # its quorum is known (wait_quorum ran)
    heal_fut: Future | None = None  # the state fetch, when this group heals this step
    has_work: bool = True
    contributors: int = 0
    errors: list[str] = field(default_factory=list)
    reran: bool = False  # its exchange re-ran in the survivors' quorum
    busy: Busy | None = None  # its compute, reported with the next round's request
    t_quorum: float = 0.0
    t_allreduce: float = 0.0
    healed_step: int | None = None  # the step whose state it loaded from a peer
    idle: int = -1  # its quorum id if nobody had work in it


@dataclass
class Standing:
    """Where this group stands between steps."""

    committed: bool = False  # the last step committed (in Manager.quorum)
    committed_at: float = field(default_factory=time.monotonic)
    lease_until: float = 0.0  # monotonic: the last granted quorum may be reused until then
    standby_until: float = 0.0  # monotonic: held out as slow (Standby) until then
    # lighthouse id, members (identity_key) and settled (Quorum.settled) of the last quorum applied
    trained_in: tuple[str, str, bool] = ("", "", False)


class Manager:
    """One rank's step protocol. `group_pg`: the process group of this replica group's own
    ranks (None: one rank); `lighthouse_client`: makes the client (the real one by default)."""

    def __init__(
        self,
        cfg: ManagerConfig,
        state_dict: Callable[[], Any],
        load_state_dict: Callable[[Any], None],
        group_pg: dist.ProcessGroup | None = None,
        step: int = 0,
        faults: list[Fault] | None = None,
        lighthouse_client: ClientFactory = LighthouseClient,
    ):
        if cfg.lr_policy not in LR_POLICIES:
            raise ValueError(f"ftcore: lr_policy {cfg.lr_policy!r} is not one of {LR_POLICIES}")
        if not 0 <= cfg.group < cfg.num_groups:
            raise ValueError(
                f"ftcore: replica group {cfg.group} is outside 0..{cfg.num_groups - 1} "
                "(FTREC_REPLICA_GROUP, FTREC_NUM_REPLICA_GROUPS)"
            )
        self.cfg = cfg
        cfg.host = cfg.host or netaddr.rank_host(cfg.lighthouse)
        if cfg.incarnation is None:
            cfg.incarnation = agree_incarnation(group_pg)
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self._group_pg = group_pg
        self.step = step
        self.injector = Injector(faults or [], cfg.group, cfg.rank, cfg.incarnation)
        self._xg = CrossGroup(cfg.host, cfg.backend)
        self.heal_server = HealServer(cfg.host, cfg.token, on_serve=self._on_serve)
        info = RankInfo(
            group=cfg.group,
            rank=cfg.rank,
            world=cfg.world,
            incarnation=cfg.incarnation,
            job=cfg.job,
            num_groups=cfg.num_groups,
            min_replicas=cfg.min_replicas,
            step=step,
            store=f"{cfg.host}:{self._xg.store.port}",
            heal=self.heal_server.address,
        )
        self.relay, addr = _relay(cfg, info, group_pg)
        self.client = lighthouse_client(addr, info, cfg.token)
        self.client.start_heartbeats()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftcore-quorum")
        self._heal_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftcore-heal")
        self._quorum: Quorum | None = None
        self._r = Round(QuorumRequest(info), (None, 0.0))  # the current step attempt
        self._st = Standing()
        self._round_lock = threading.Lock()  # a round either takes its reply or leases, never both
        self._ignored_step = -1  # the step of the last quorum answer given up unapplied (under _round_lock)
        # per step of this group's that every member ran: (straggler s: waiting for the slowest
        # group, FTAR s, the slowest group's compute s, the groups' mean compute s); drained by the trainer
        self.pace_log: list[tuple[float, float, float, float]] = []
        if cfg.records:  # named after the incarnation, which may only now be agreed
            cfg.records = cfg.records.replace("{incarnation}", str(cfg.incarnation))
        self._records_fd = os.open(cfg.records, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if cfg.records else None

    # ---- quorum ---------------------------------------------------------------------
    def start_quorum(self) -> None:
        """Begin this step's quorum in the background (the step has work until set_work says not)."""
        if self.client.replaced:
            raise Replaced(f"replica group {self.cfg.group} incarnation {self.cfg.incarnation} was replaced")
        if time.monotonic() - self._st.committed_at > timeouts.STUCK_TIMEOUT:
            raise RuntimeError(
                f"ftcore: replica group {self.cfg.group} has not committed a step for "
                f"{timeouts.STUCK_TIMEOUT:.0f}s (FTCORE_STUCK_TIMEOUT); giving up so it can be restarted"
            )
        self.client.update(step=self.step)
        last = self._r  # its compute and FTAR time ride on this round's request (fail-slow)
        with self._round_lock:
            # The request reports this step even when it goes out late (its thread was still
            # waiting on a leased round's request) and this group has committed meanwhile: a
            # later step in it would make the lighthouse heal the others "up" to it.
            ask = QuorumRequest(self.client.info, *self._st.trained_in, busy=last.busy, idle=last.idle)
            r = self._r = Round(ask, (last.busy, last.t_allreduce))
            r.fut = self._pool.submit(self._run_quorum, r)

    def _run_quorum(self, r: Round) -> Quorum | None:
        if r is not self._r:
            return None  # a later step asked already (this one ran on a lease): nothing to do
        time.sleep(max(self._st.standby_until - time.monotonic(), 0.0))
        with self._round_lock:  # a request that leaves after its step leased says so (lighthouse _drop_overtaken)
            ask = replace(r.ask, leased=r.leased, again=self._ignored_step == r.ask.info.step)
        try:
            q = self.client.quorum(request=ask, leased=lambda: r.leased)
        except Overtaken:
            return None  # only a leased round is overtaken, and a leased round ignores its answer
        with self._round_lock:
            if r is not self._r or r.leased:
                # answered after its step went on without it: no side effects; a retry of this
                # step asks for the same answer (its peers may wait for this group in that quorum)
                self._ignored_step = ask.info.step
                return None
            r.answered = True
            self._ignored_step = -1
        r.t_quorum = time.monotonic() - r.t0
        return self._apply_quorum(q)

    def _apply_quorum(self, q: Quorum) -> Quorum:
        r = self._r
        r.answer = q
        pace, (busy, allreduce_s) = q.pace, r.sent
        if pace is not None and busy is not None and pace.quorum_id == busy.quorum_id and len(self.pace_log) < 10_000:
            self.pace_log.append((max(pace.slowest_s - busy.seconds, 0.0), allreduce_s, pace.slowest_s, pace.mean_s))
        # from before the request went out: it ends before the lighthouse's own count of it does
        self._st.lease_until = r.t0 + min(q.lease_s, timeouts.LEASE)
        self.client.update(quorum_id=q.quorum_id)
        self._st.trained_in = (q.lighthouse_id, q.members_key, q.settled)
        g = self.cfg.group
        if g in q.heal:  # rank k heals from rank k of the source
            r.heal_fut = self._heal_pool.submit(self._fetch_heal, q.heal_from, q.max_step, q.heal[g])
        if q.key != self._xg.key:
            abort, on_stall = (lambda: self._overtaken(q)), (lambda: self._report_stall(q))
            self._xg.build(q, g, self.cfg.rank, abort=abort, on_stall=on_stall)
        if g in q.heal.values() and self.step == q.max_step:
            # We are a heal source: snapshot before this step's optimizer update.
            self.heal_server.offer(self.step, self._state_dict())
        elif g not in q.heal.values():  # no heal of this quorum needs the last snapshot: its memory back
            self.heal_server.withdraw("snapshot")  # (a download under way keeps its own reference)
        self._quorum = q
        return q

    def _fetch_heal(self, addr: str, step: int, src: int) -> Any:
        t = time.monotonic()
        self.client.event("heal_started", source=src, step=step)
        tree = fetch(addr, step, self.cfg.token, abort=self._failed(src))
        self.client.event("heal_fetched", source=src, step=step, seconds=time.monotonic() - t)
        return tree

    def _failed(self, g: int) -> Callable[[], bool]:
        """Whether the lighthouse has failed group g: a fetch from a hung peer (its connection
        open, nothing sent) gives up then, within the failure probe, not after its timeout. Not
        when a newer quorum forms: a large heal may outlast the join timeout and still land."""
        return lambda: g in self.client.failed_groups

    def _on_serve(self, step: int) -> None:
        self.injector.phase("heal_serve", step)

    def _is_stale(self) -> bool:
        return self._quorum is not None and (self._overtaken(self._quorum) or self._lease_lapsed())

    def _lease_lapsed(self) -> bool:
        """This step went on under the lease, its exchange stalled, and the lighthouse answers
        again: a peer that heard it back a moment sooner asked it for this step instead of
        leasing, and waits there. The step fails, reported (its exchange is abandoned mid-way:
        the lighthouse has every process group rebuilt), and both meet in the next round, not
        after the whole collective timeout."""
        r = self._r
        return r.leased and r.stalled and self.client.silent_for() < timeouts.LIGHTHOUSE_SILENT

    def _overtaken(self, q: Quorum) -> bool:
        """A member of q's exchange failed, a member reported it failed (it was abandoned: a rank
        only now reaching its rendezvous would wait for peers who already left), or a newer
        quorum formed (the lighthouse's word)."""
        # a member aside that fails (a dying heal source) is no peer of this exchange
        c = self.client
        return (
            any(g in q.exchange() for g in c.failed_groups)
            or 0 < q.quorum_id <= c.abandoned_quorum_id
            or c.latest_quorum_id > q.quorum_id
        )

    def _fail(self, msg: str, report: bool = False) -> None:
        self._r.errors.append(msg)
        if report:
            self._report(msg)

    def _report(self, msg: str) -> None:
        """Tell the lighthouse now; do not wait for a heartbeat timeout. Synchronous (a
        loopback call): the next quorum request must find it recorded. It names the quorum
        whose exchange failed, its group's rendezvous included (the lighthouse rebuilds it)."""
        q = self._quorum or self._r.answer
        qid = q.quorum_id if q else 0
        self.client.report_failure(qid, msg)
        self._xg.drop()

    def _report_stall(self, q: Quorum | None = None) -> None:
        """A wait on the members of quorum q (by default the current one) made no progress for
        STALL_PROBE, in its FTAR or in the rendezvous that builds its group: the lighthouse
        probes them now (a partitioned or hung peer closes no connection). Sent from a thread
        of its own: the wait goes on polling for the verdict meanwhile."""
        self._r.stalled = True
        q = q or self._quorum
        qid = q.quorum_id if q else 0
        why = f"no progress in the exchange of quorum {qid} for {timeouts.STALL_PROBE} s"
        threading.Thread(target=self.client.report_failure, args=(qid, why, True), daemon=True).start()

    def wait_quorum(self) -> Quorum | None:
        """Block until this step's quorum is known: the quorum, or None when the step already
        failed (the error is recorded once)."""
        if self._r.waited:
            return self._quorum
        self._r.waited = True
        if self._r.fut is None:
            raise RuntimeError("ftcore: call start_quorum() at the start of every step")
        deadline = time.monotonic() + timeouts.QUORUM_TIMEOUT + timeouts.COLLECTIVE_TIMEOUT
        try:
            while True:
                try:
                    return self._r.fut.result(timeout=min(0.02, max(deadline - time.monotonic(), 0.001)))
                except FutureTimeout:
                    with self._round_lock:
                        self._r.leased = not self._r.answered and self._can_lease()
                    if self._r.leased:
                        return self._settle()
                    if time.monotonic() >= deadline:
                        raise
        except Replaced:
            raise
        except Standby as e:  # held out as slow: alive, not stuck; the step fails and is retried later
            self._quorum = None
            self._st.standby_until = self._st.committed_at = time.monotonic()
            self._st.standby_until += e.retry_s
            self._r.errors.append(f"standby: {e}")
            return None
        except Exception as e:  # LighthouseError, store/PG construction errors, timeouts
            self._quorum = None
            self._fail(f"quorum: {type(e).__name__}: {e}", report=not isinstance(e, LighthouseError))
            return None

    def _can_lease(self) -> bool:
        """Go on without the lighthouse: it has been silent (not merely slow to form a round:
        it answers heartbeats at once), the last step committed, and that quorum's lease has not
        run out. Its members commit only together (the FTAR needs every one), and the lighthouse
        forms no quorum without one of them while the lease may run (quorum.decide): a group
        standing aside, or down, waits for the lighthouse, and no group commits alone against a
        quorum it cannot see. After a heal step they go on in the settled quorum (`_settle`)."""
        q = self._quorum
        return (
            q is not None
            and self._st.committed
            and time.monotonic() < self._st.lease_until
            and not self._overtaken(q)  # no newer quorum, no member failed, not abandoned
            and self._xg.key == q.key  # its exchange stands as built for q (no failure dropped it)
            and self.client.silent_for() > timeouts.LIGHTHOUSE_SILENT
        )

    def _settle(self) -> Quorum | None:
        """The quorum a leased step goes on in: the last one, or once a heal step committed, the
        same members with the heal done (Quorum.settle). A heal quorum's layout cannot go on
        as it is: its exchange would run ahead of the members aside, with no round between them.
        Its process group is built here, with every member (bounded: a member that healed and did
        not commit does not lease, and the step fails as one whose exchange failed)."""
        q = self._quorum
        if q is None or not q.heal:
            return q
        settled = self._quorum = q.settle()
        self._st.trained_in = (settled.lighthouse_id, settled.members_key, settled.settled)
        if settled.key == self._xg.key:  # nobody was aside: its exchange's group holds every member
            return settled
        try:
            abort, on_stall = (lambda: self._overtaken(settled)), (lambda: self._report_stall(settled))
            self._xg.build(settled, self.cfg.group, self.cfg.rank, abort=abort, on_stall=on_stall)
        except Exception as e:  # store or process-group errors: the step fails, the lease is over
            self._quorum = None
            self._fail(f"lease: the settled quorum's group: {type(e).__name__}: {e}")
        return self._quorum

    # ---- FTAR -----------------------------------------------------------------------
    @property
    def healing(self) -> bool:
        """This step, this group receives the state (and the step's average). Known once
        wait_quorum() returned (before, and in a step without a quorum: False); never blocks."""
        return self._r.heal_fut is not None

    def set_work(self, has_work: bool) -> None:
        """Whether this group trains a batch this step (False: it joins with zero gradients)."""
        self._r.has_work = has_work

    @property
    def contributors(self) -> int:
        return self._r.contributors

    @property
    def quorum_seconds(self) -> float:
        """How long this step's quorum took (it overlaps the forward pass)."""
        return self._r.t_quorum

    def allreduce(self, tensors: list[torch.Tensor], same_batch: Callable[[Quorum], bool] | None = None) -> None:
        """Average `tensors` in place across replica groups (FTAR). Never raises on peer failure.

        `same_batch(quorum)`: whether the batch this group computed is still its batch in that
        quorum. Given, a peer's failure in the exchange does not cost the step: the survivors
        take the next quorum at once, in this step, and re-run only the exchange on the
        gradients they computed (kept as a copy while the exchange runs), when nobody is
        ahead of them and `same_batch` says so; otherwise the step fails as without it."""
        t = time.monotonic()
        q = self.wait_quorum()
        if q is None:
            return
        self.injector.slow(self.step)
        local_error = False
        try:
            self.injector.phase("before_allreduce", self.step)
        except InjectedFault as e:
            local_error = True
            self._r.errors.append(str(e))
        contribute = self._r.has_work and not self.healing
        if contribute:  # this step's compute, from its start to here: what fail-slow compares
            self._r.busy = Busy(q.quorum_id, round(time.monotonic() - self._r.t0, 6))
        # a healing group joins at the step it is about to receive
        step = q.max_step if self._r.heal_fut is not None else self.step
        if self.cfg.group in q.aside():
            try:
                src = self._failed(q.exchange()[0])
                self._r.contributors = aside.take_average(tensors, q, step, self.cfg.token, abort=src)
            except HealError as e:
                self._r.errors.append(f"update: {e}")
            finally:
                self._r.t_allreduce = time.monotonic() - t
            return
        res = None
        try:
            res = self._exchange(tensors, same_batch, contribute, local_error, step)
        finally:
            self._r.t_allreduce = time.monotonic() - t
            final = self._quorum if self._quorum is not None else q
            aside.offer_average(self.heal_server, self.cfg.group, (q, final), tensors, res, step)
        if res is None:
            return
        self._r.contributors = res.contributors
        if res.peer_error and not local_error:
            self._r.errors.append("a replica group flagged a failure during the all-reduce")
        elif res.peer_error:
            self._r.errors.append("this group failed during the all-reduce")
        try:
            self.injector.phase("after_allreduce", self.step)
        except InjectedFault as e:
            self._r.errors.append(str(e))

    def _exchange(self, tensors, same_batch, contribute: bool, local_error: bool, step: int) -> FTARResult | None:
        """FTAR in this step's quorum, re-run once in the survivors' when a peer failed it and
        the batch is still this group's there; None: the step failed (recorded)."""
        saved = (
            [x.detach().clone() for x in tensors]
            if same_batch is not None and self._xg.pg is not None and self._r.heal_fut is None
            else None
        )
        try:
            return self._ftar(tensors, contribute, local_error, step)
        except FTARError as e:
            why = "lease given up: a peer asks the lighthouse for this step" if self._lease_lapsed() else str(e)
            self._report(why)
            if saved is None or same_batch is None or local_error or self._requorum(same_batch) is None:
                self._r.errors.append(why)
                return None
        for x, keep in zip(tensors, saved, strict=True):  # the step goes on, in the survivors' quorum
            x.copy_(keep)
        self._r.reran = True
        try:
            return self._ftar(tensors, contribute, False, step)
        except FTARError as e2:
            self._fail(str(e2), report=True)
            return None

    def _ftar(self, tensors: list[torch.Tensor], contribute: bool, local_error: bool, step: int):
        return ftar(
            self._xg.pg,
            tensors,
            contribute=contribute,
            local_error=local_error,
            timeout=timeouts.COLLECTIVE_TIMEOUT,
            is_stale=self._is_stale,
            stall_s=timeouts.STALL_PROBE,
            on_stall=self._report_stall,
            bucket_bytes=self.cfg.bucket_bytes,
            during=lambda: self.injector.phase("during_allreduce", self.step),
            step=step,
        )

    def _requorum(self, same_batch: Callable[[Quorum], bool]) -> Quorum | None:
        """The quorum after a peer failed this step's exchange, taken now (the lighthouse already
        knows: the peer's connection closed, and this rank just reported it), when this group
        can re-run the exchange in it: not healing, nobody ahead, the same batch. Not on a lease:
        that round's own request still waits on the lighthouse (and owns the connection)."""
        if self._r.leased:
            return None
        try:
            q = self.client.quorum(request=self._r.ask)
        except Replaced:
            raise
        except LighthouseError:  # unreachable, on standby: the step fails, the next one asks again
            return None
        if self.cfg.group in q.heal or self.cfg.group in q.aside() or q.max_step != self.step:
            with self._round_lock:  # answered, not applied: the next request asks for this answer again
                self._ignored_step = self._r.ask.info.step  # (its peers wait for this group in that quorum)
            return None
        try:
            self._apply_quorum(q)
        except Exception as e:  # the new process group could not be built: as any failed step
            self._quorum = None
            self._fail(f"quorum: {type(e).__name__}: {e}", report=True)
            return None
        return q if same_batch(q) else None

    # ---- commit ---------------------------------------------------------------------
    def should_commit(self) -> bool:
        """The group's vote. True: apply the averaged update now; False: drop it and retry."""
        q = self.wait_quorum()
        try:
            self.injector.phase("vote", self.step)
        except InjectedFault as e:
            self._r.errors.append(str(e))
        if self._r.heal_fut is not None and q is not None:
            try:
                tree = self._r.heal_fut.result(timeout=timeouts.HEAL_TIMEOUT)
                self._load_state_dict(tree)
                self.step = q.max_step
                self._r.healed_step = self.step
                self.client.event("heal_finished", step=self.step)
            except Exception as e:  # HealError, a state that does not fit the model, a timeout
                self._fail(f"heal: {type(e).__name__}: {e}")
        participants = len(q.groups) if q else 0
        ok = not self._r.errors and participants >= self.cfg.min_replicas and self._r.contributors > 0
        # Nobody had work (only an absent group's make-up is left): the lighthouse ends its standby.
        self._r.idle = q.quorum_id if q and not self._r.errors and not self._r.contributors else -1
        ok = self._group_vote(ok, q.quorum_id if q else -1)
        lr = self.lr_scale()
        self._st.committed = ok
        if ok:
            self.step += 1
            self._st.committed_at = time.monotonic()
            self.client.update(step=self.step)
        r = self._r
        rec = StepRecord(
            step=self.step,
            quorum_id=q.quorum_id if q else 0,
            participants=participants,
            contributors=r.contributors,
            healing=r.heal_fut is not None,
            committed=ok,
            lr_scale=lr,
            quorum_s=r.t_quorum,
            allreduce_s=r.t_allreduce,
            t=time.time(),
            error="; ".join(r.errors)[:300],
            leased=r.leased,
            requorum=r.reran,
            idle=r.idle >= 0 and not r.errors,
        )
        if self._records_fd is not None:
            line = {"group": self.cfg.group, "rank": self.cfg.rank, "incarnation": self.cfg.incarnation, **rec.__dict__}
            os.write(self._records_fd, (json.dumps(line) + "\n").encode())
        return ok

    def _group_vote(self, ok: bool, quorum_id: int) -> bool:
        """Every rank of the group succeeded, in the same quorum (one rank on a lease and another
        in a new quorum must not both commit: their gradients were averaged over different groups)."""
        if self.cfg.world == 1:
            return ok
        flag = torch.tensor([1 if ok else 0, quorum_id, -quorum_id], dtype=torch.int64)
        try:
            coll.all_reduce(flag, kind=coll.CONTROL, op=dist.ReduceOp.MIN, group=self._group_pg)
        except Exception as e:  # a rank of our own group died: the launcher restarts the group
            self._r.errors.append(f"group vote: {e}")
            return False
        if flag[1].item() != -flag[2].item():
            self._r.errors.append("group vote: the group's ranks were in different quorums")
            return False
        return bool(flag[0].item())

    def lr_scale(self) -> float:
        """Learning-rate multiplier for this step's participation (policy none/linear/sqrt)."""
        live, total = max(self._r.contributors, 1), max(self.cfg.num_groups, 1)
        if self.cfg.lr_policy == "linear":
            return live / total
        if self.cfg.lr_policy == "sqrt":
            return math.sqrt(live / total)
        return 1.0

    @property
    def quorum(self) -> Quorum | None:
        return self._quorum

    @property
    def healed_step(self) -> int | None:
        """The step whose state this step loaded from a peer (set by should_commit), else None."""
        return self._r.healed_step

    @property
    def errors(self) -> list[str]:
        return list(self._r.errors)

    def shutdown(self, leave: bool = True) -> None:
        if leave:
            self.client.leave()
        else:
            self.client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._heal_pool.shutdown(wait=False, cancel_futures=True)
        self.heal_server.close()
        if self.relay is not None:
            self.relay.close()
