"""The manager: the FT-HSDP step protocol inside one rank of one replica group.

Per step (a transaction: it commits on every group or on none):

    start_quorum()    asynchronous: ask the lighthouse; on a new quorum_id build the
                      cross-group process group (rank k of every group, on a fresh
                      store prefix); start a heal fetch or offer a heal snapshot
    allreduce(ts)     FTAR across groups: SUM / contributors, healing groups send zeros
    should_commit()   all ranks of the group vote; commit only if every rank succeeded
                      and the quorum has >= min_replicas groups; a recovering group
                      loads the healed state here, before the optimizer step

Errors never escape as crashes: a failed quorum, collective or heal makes the step
fail (should_commit() is False) and the trainer retries the same batch. While the
lighthouse is silent, a step whose group committed the last one in an unchanged quorum
runs in that quorum on its lease (timeouts.LEASE) instead of waiting. Data-plane
errors are reported to the lighthouse at once so the survivors re-form without
waiting for a heartbeat timeout. Each quorum request carries the compute time of the
group's last step (fail-slow, ftcore/pace.py); a group the lighthouse holds out as slow
gets `Standby`: its steps fail without an error report until it is readmitted and heals.

The lighthouse client is a constructor argument (`lighthouse_client`, by default the real
LighthouseClient), so the step protocol can be driven in one process by a fake
(tests/test_ftcore_manager.py).
"""

import datetime
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

from ftcore import auth, netaddr, timeouts
from ftcore import collectives as coll
from ftcore import faults as faults_mod
from ftcore.ftar import DEFAULT_BUCKET_BYTES, FTARError, ftar
from ftcore.heal import HealServer, fetch
from ftcore.lighthouse_client import LighthouseClient, LighthouseError, LighthouseLink, Overtaken, Replaced, Standby
from ftcore.messages import MAX_ADDRESS, Busy, Identity, Quorum, QuorumRequest, RankInfo
from ftcore.relay import Relay

# makes this rank's lighthouse client: (lighthouse host:port, what the rank reports, token)
ClientFactory = Callable[[str, RankInfo, str | None], LighthouseLink]

LR_POLICIES = ("none", "linear", "sqrt")
# A group that has not committed for this long gives up (its process exits non-zero and
# the launcher restarts it) instead of retrying forever.
STUCK_TIMEOUT = timeouts._env("FTCORE_STUCK_TIMEOUT", 120.0)


@dataclass
class ManagerConfig:
    lighthouse: str  # host:port
    group: int  # this replica group, 0..num_groups-1
    num_groups: int  # R: replica groups the job was planned with (LR policy, make-up)
    rank: int = 0  # k: rank within the group
    world: int = 1  # K: ranks per group
    incarnation: int | None = 0  # bumps each time the group is restarted; None: agreed at start (see below)
    min_replicas: int = 1
    lr_policy: str = "sqrt"
    token: str | None = None
    host: str = ""  # where this rank's store, heal server and gloo listen (ftcore/netaddr.py)
    job: str = "default"  # one lighthouse serves several jobs; their quorums never mix
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    records: str | None = None  # append every StepRecord here as a JSON line ("{incarnation}" is filled in)
    # cross-group data plane: "gloo" always, CUDA gradients host-staged (ftcore/ftar.py says why).
    # "nccl" is fenced: opt-in only (FTCORE_BACKEND=nccl), never run on a GPU here, and a hung
    # peer there is ended by NCCL's watchdog tearing the survivors down, not by FTAR (_new_pg).
    backend: str = "gloo"
    # a group of several ranks speaks to the lighthouse through its rank 0 (ftcore/relay.py)
    relay: bool = True


# The environment of one rank: what torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK) plus these,
# the same under `torchrun` on a cluster and under the local launcher (README, "Running on a
# cluster"). FTCORE_TOKEN / FTCORE_TOKEN_FILE carry the lighthouse's token (ftcore/auth.py).
ENV = {
    "FTCORE_LIGHTHOUSE": "host:port of the lighthouse (required)",
    "FTREC_REPLICA_GROUP": "this replica group's id, 0..R-1 (default 0)",
    "FTREC_NUM_REPLICA_GROUPS": "R, the replica groups the job is planned with (default 1)",
    "FTCORE_JOB_ID": "the job's id on a lighthouse that serves several jobs (default 'default')",
    "FTCORE_HOST": "address this rank binds and advertises (default: derived, ftcore/netaddr.py)",
    "FTCORE_INCARNATION": "this start of the group; unset: agreed by the group's ranks at start",
    "FTCORE_MIN_REPLICAS": "fewest replica groups a step may commit with (default 1)",
    "FTCORE_LR_POLICY": "none, linear or sqrt (default sqrt)",
    "FTCORE_BACKEND": "cross-group data plane: gloo (default; CUDA gradients host-staged) or nccl (fenced, unverified)",
    "FTCORE_RELAY": "1 (default): a group's rank 0 speaks to the lighthouse for its ranks; 0: every rank does",
}


def _env_int(name: str, default: str) -> int:
    raw = os.environ.get(name, default)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"ftcore: environment variable {name}={raw!r} is not an integer") from None


def config_from_env(**overrides: Any) -> ManagerConfig:
    """The manager's configuration from the rank's environment (ENV above)."""
    env = os.environ
    if not env.get("FTCORE_LIGHTHOUSE"):
        raise ValueError(
            "ftcore: FTCORE_LIGHTHOUSE is not set; start ranks with the launcher "
            "(python -m training launch) or set it to the lighthouse's host:port"
        )
    cfg = ManagerConfig(
        lighthouse=env["FTCORE_LIGHTHOUSE"],
        group=_env_int("FTREC_REPLICA_GROUP", "0"),
        num_groups=_env_int("FTREC_NUM_REPLICA_GROUPS", "1"),
        rank=_env_int("RANK", "0"),
        world=_env_int("WORLD_SIZE", "1"),
        # torchrun's restart count is per node (a replaced node starts at 0), so it cannot name
        # a restart of a group that spans nodes: without FTCORE_INCARNATION the ranks agree.
        incarnation=_env_int("FTCORE_INCARNATION", "0") if env.get("FTCORE_INCARNATION") else None,
        min_replicas=_env_int("FTCORE_MIN_REPLICAS", "1"),
        lr_policy=env.get("FTCORE_LR_POLICY", "sqrt"),
        token=_job_token(auth.token_from_env(), env.get("FTCORE_JOB_ID") or "default"),
        host=netaddr.rank_host(env["FTCORE_LIGHTHOUSE"]),
        job=env.get("FTCORE_JOB_ID") or "default",
        records=env.get("FTCORE_RECORDS"),
        backend=env.get("FTCORE_BACKEND", "gloo"),
        relay=env.get("FTCORE_RELAY", "1") != "0",
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _job_token(token: str | None, job: str) -> str | None:
    """The credential a rank uses on the wire and serves heals under: its job's token, even when
    it was handed the lighthouse's secret (ftcore/auth.py)."""
    try:
        return auth.job_token(token, job) if token else None
    except ValueError as e:
        raise ValueError(f"ftcore: FTCORE_TOKEN / FTCORE_TOKEN_FILE: {e}") from None


def agree_incarnation(group_pg: dist.ProcessGroup | None) -> int:
    """A new incarnation number that every rank of the group shares: rank 0's clock in
    milliseconds, broadcast over the group. It grows across restarts by any scheduler (a
    restart takes longer than the clock's error between two starts of rank 0)."""
    t = torch.tensor([time.time_ns() // 1_000_000], dtype=torch.int64)
    if group_pg is not None and coll.get(group_pg).size() > 1:
        coll.broadcast(t, 0, kind=coll.CONTROL, group=group_pg)
    return int(t.item())


def _new_pg(
    backend: str, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, host: str = "127.0.0.1"
) -> dist.ProcessGroup:
    """One quorum's cross-group process group, its gloo listening on `host` only (with a gloo
    twin for control values beside any other backend, ftcore/collectives.py).

    "nccl" is fenced (ManagerConfig.backend): written for CUDA tensors, never run on a GPU here.
    Its hang handling is NCCL's: the group's timeout arms the watchdog, which with
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 aborts a blocked collective by ending the process, so a
    peer's SIGSTOP restarts the survivors too; FTAR's deadline cannot cancel an NCCL kernel."""
    try:
        return coll.new_pg(backend, store, rank, size, timeout, host)
    except ValueError as e:
        raise ValueError(f"ftcore: {e} (FTCORE_BACKEND)") from None


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


def faults_from_env() -> list[faults_mod.Fault]:
    path = os.environ.get("FTCORE_FAULTS")
    return faults_mod.load(path) if path else []


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
        faults: list[faults_mod.Fault] | None = None,
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
        self.injector = faults_mod.Injector(faults or [], cfg.group, cfg.rank, cfg.incarnation)
        # Rendezvous store for the cross-group groups this rank leads (as rank k of the leader
        # group), on a socket bound to cfg.host alone (TCPStore's own listens everywhere).
        fd, port = netaddr.listen_fd(cfg.host)
        self._store = dist.TCPStore(
            cfg.host,
            port,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=fd,
            timeout=datetime.timedelta(seconds=timeouts.COLLECTIVE_TIMEOUT),
        )
        self._stores: dict[str, dist.TCPStore] = {}
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
            store=f"{cfg.host}:{self._store.port}",
            heal=self.heal_server.address,
        )
        self.relay, addr = _relay(cfg, info, group_pg)
        self.client = lighthouse_client(addr, info, cfg.token)
        self.client.start_heartbeats()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftcore-quorum")
        self._heal_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftcore-heal")
        self._pg: dist.ProcessGroup | None = None  # this quorum's cross-group process group
        self._pg_id: tuple[str, int] | None = None  # ... and the Quorum.key it was built for
        self._quorum: Quorum | None = None
        self._trained_in: tuple[str, Identity] = ("", ())  # lighthouse id and members of the last quorum applied
        self._r = Round(QuorumRequest(info), (None, 0.0))  # the current step attempt
        self._lease_until = 0.0  # monotonic: the last granted quorum may be reused until then
        self._last_ok = False  # the last step committed (in self._quorum)
        self._round_lock = threading.Lock()  # a round either takes its reply or leases, never both
        self._ignored_step = -1  # the step of the last quorum answer given up unapplied (quorum worker only)
        self._last_commit = time.monotonic()
        self._standby_until = 0.0  # monotonic: held out as slow (Standby) until then
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
        if time.monotonic() - self._last_commit > STUCK_TIMEOUT:
            raise RuntimeError(
                f"ftcore: replica group {self.cfg.group} has not committed a step for "
                f"{STUCK_TIMEOUT:.0f}s (FTCORE_STUCK_TIMEOUT); giving up so it can be restarted"
            )
        self.client.update(step=self.step)
        last = self._r  # its compute and FTAR time ride on this round's request (fail-slow)
        with self._round_lock:
            # The request reports this step even when it goes out late (its thread was still
            # waiting on a leased round's request) and this group has committed meanwhile: a
            # later step in it would make the lighthouse heal the others "up" to it.
            ask = QuorumRequest(self.client.info, *self._trained_in, busy=last.busy, idle=last.idle)
            r = self._r = Round(ask, (last.busy, last.t_allreduce))
            r.fut = self._pool.submit(self._run_quorum, r)

    def _run_quorum(self, r: Round) -> Quorum | None:
        if r is not self._r:
            return None  # a later step asked already (this one ran on a lease): nothing to do
        time.sleep(max(self._standby_until - time.monotonic(), 0.0))
        with self._round_lock:  # a request that leaves after its step leased says so (lighthouse _drop_overtaken)
            ask = replace(r.ask, leased=r.leased, again=self._ignored_step == r.ask.info.step)
        try:
            q = self.client.quorum(request=ask)
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
        pace, (busy, allreduce_s) = q.pace, r.sent
        if pace is not None and busy is not None and pace.quorum_id == busy.quorum_id and len(self.pace_log) < 10_000:
            self.pace_log.append((max(pace.slowest_s - busy.seconds, 0.0), allreduce_s, pace.slowest_s, pace.mean_s))
        self._lease_until = time.monotonic() + min(q.lease_s, timeouts.LEASE)
        self.client.update(quorum_id=q.quorum_id)
        self._trained_in = (q.lighthouse_id, q.identity)
        g = self.cfg.group
        if g in q.heal:  # rank k heals from rank k of the source
            r.heal_fut = self._heal_pool.submit(self._fetch_heal, q.heal_from, q.max_step, q.heal[g])
        if q.key != self._pg_id:
            self._build_pg(q)
        if g in q.heal.values() and self.step == q.max_step:
            # We are a heal source: snapshot before this step's optimizer update.
            self.heal_server.offer(self.step, self._state_dict())
        self._quorum = q
        return q

    def _build_pg(self, q: Quorum) -> None:
        old, self._pg, self._pg_id = self._pg, None, None
        if old is not None:
            _retire(old)
        groups = q.groups
        if len(groups) > 1:
            leader = q.store  # rank k of the first group hosts rank k's rendezvous
            store = self._stores.get(leader)
            if store is None:
                host, _, port = leader.rpartition(":")
                store = dist.TCPStore(
                    host,
                    int(port),
                    is_master=False,
                    wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeouts.COLLECTIVE_TIMEOUT),
                )
                self._stores[leader] = store
            prefix = f"ftcore/{q.lighthouse_id}/{q.quorum_id}/{self.cfg.rank}"
            # A fresh prefix per quorum: the default process group cannot shrink or grow.
            self._pg = _new_pg(
                self.cfg.backend,
                dist.PrefixStore(prefix, store),
                groups.index(self.cfg.group),
                len(groups),
                datetime.timedelta(seconds=timeouts.COLLECTIVE_TIMEOUT),
                self.cfg.host,
            )
        self._pg_id = q.key

    def _fetch_heal(self, addr: str, step: int, src: int) -> Any:
        t = time.monotonic()
        self.client.event("heal_started", source=src, step=step)
        tree = fetch(addr, step, self.cfg.token)
        self.client.event("heal_fetched", source=src, step=step, seconds=time.monotonic() - t)
        return tree

    def _on_serve(self, step: int) -> None:
        self.injector.phase("heal_serve", step)

    def _is_stale(self) -> bool:
        q = self._quorum
        return q is not None and (
            any(g in q.groups for g in self.client.failed_groups) or self.client.latest_quorum_id > q.quorum_id
        )

    def _fail(self, msg: str, report: bool = False) -> None:
        self._r.errors.append(msg)
        if report:
            self._report(msg)

    def _report(self, msg: str) -> None:
        """Tell the lighthouse now; do not wait for a heartbeat timeout. Synchronous (a
        loopback call): the next quorum request must find it recorded."""
        qid = self._quorum.quorum_id if self._quorum else 0
        self.client.report_failure(qid, msg)
        pg, self._pg, self._pg_id = self._pg, None, None
        if pg is not None:
            _retire(pg)

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
                        return self._quorum
                    if time.monotonic() >= deadline:
                        raise
        except Replaced:
            raise
        except Standby as e:  # held out as slow: alive, not stuck; the step fails and is retried later
            self._quorum = None
            self._standby_until = self._last_commit = time.monotonic()
            self._standby_until += e.retry_s
            self._r.errors.append(f"standby: {e}")
            return None
        except Exception as e:  # LighthouseError, store/PG construction errors, timeouts
            self._quorum = None
            self._fail(f"quorum: {type(e).__name__}: {e}", report=not isinstance(e, LighthouseError))
            return None

    def _can_lease(self) -> bool:
        """Go on without the lighthouse: it has been silent (not merely slow to form a round:
        it answers heartbeats at once), the last step committed in a quorum of the whole job
        (every group: none is down and waiting to rejoin, which only the lighthouse can let
        it do, nor could the job end while one is away) with nobody to heal, and that
        quorum's lease has not run out."""
        q = self._quorum
        return (
            q is not None
            and self._last_ok
            and not q.heal
            and time.monotonic() < self._lease_until
            and len(q.groups) >= self.cfg.num_groups
            and self.client.latest_quorum_id <= q.quorum_id
            and (self._pg is not None or len(q.groups) == 1)
            and self.client.silent_for() > timeouts.LIGHTHOUSE_SILENT
        )

    # ---- FTAR -----------------------------------------------------------------------
    @property
    def healing(self) -> bool:
        """This step, this group receives the state and sends zero gradients. Known once
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
        except faults_mod.InjectedFault as e:
            local_error = True
            self._r.errors.append(str(e))
        contribute = self._r.has_work and not self.healing
        if contribute:  # this step's compute, from its start to here: what fail-slow compares
            self._r.busy = Busy(q.quorum_id, round(time.monotonic() - self._r.t0, 6))
        # a healing group joins at the step it is about to receive
        step = q.max_step if self._r.heal_fut is not None else self.step
        saved = (
            [x.detach().clone() for x in tensors]
            if same_batch is not None and self._pg is not None and self._r.heal_fut is None
            else None
        )
        try:
            try:
                res = self._ftar(tensors, contribute, local_error, step)
            except FTARError as e:
                self._report(str(e))
                if saved is None or same_batch is None or local_error or self._requorum(same_batch) is None:
                    self._r.errors.append(str(e))
                    return
                for x, keep in zip(tensors, saved, strict=True):  # the step goes on, in the survivors' quorum
                    x.copy_(keep)
                self._r.reran = True
                try:
                    res = self._ftar(tensors, contribute, False, step)
                except FTARError as e2:
                    self._fail(str(e2), report=True)
                    return
        finally:
            self._r.t_allreduce = time.monotonic() - t
        self._r.contributors = res.contributors
        if res.peer_error and not local_error:
            self._r.errors.append("a replica group flagged a failure during the all-reduce")
        elif res.peer_error:
            self._r.errors.append("this group failed during the all-reduce")
        try:
            self.injector.phase("after_allreduce", self.step)
        except faults_mod.InjectedFault as e:
            self._r.errors.append(str(e))

    def _ftar(self, tensors: list[torch.Tensor], contribute: bool, local_error: bool, step: int):
        return ftar(
            self._pg,
            tensors,
            contribute=contribute,
            local_error=local_error,
            timeout=timeouts.COLLECTIVE_TIMEOUT,
            is_stale=self._is_stale,
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
        if self.cfg.group in q.heal or q.max_step != self.step:
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
        except faults_mod.InjectedFault as e:
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
        self._last_ok = ok
        if ok:
            self.step += 1
            self._last_commit = time.monotonic()
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


_retired: list[dist.ProcessGroup] = []


def _retire(pg: dist.ProcessGroup) -> None:
    """Keep an old cross-group process group referenced for the life of the process.

    Measured here: aborting or destroying a gloo group with a collective still pending
    (a hung peer) blocks the calling thread, GIL held, until that collective times out,
    which stalls this rank's training. One leaked group per quorum change is cheap.
    """
    _retired.append(pg)
