"""The launcher: R replica groups x K ranks of a worker module, each group restarted on failure.

Subclasses (the trainer's front end, training/launch.py) say what a rank runs (worker_argv,
worker_module, spare_preload), clean up after killed ranks (after_kill) and consume the
launch's records when it ends (finish): events, restarts, the groups that finished."""

import dataclasses
import json
import os
import shlex
import sys
import threading
import time

from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from ftcore import environment, faults, timeouts
from ftcore import final_state as final_state_mod
from ftcore.launcher.config import GroupFailed, LaunchConfig
from ftcore.launcher.host import LighthouseHost
from ftcore.launcher.lease import RunLease
from ftcore.launcher.procs import Proc, ProcessTable
from ftcore.launcher.spares import SparePool
from ftcore.launcher.watch import Watch
from ftcore.util.procs import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above ftcore/


class Launcher:
    def __init__(self, cfg: LaunchConfig):
        self.cfg = cfg
        self.out = os.path.abspath(cfg.out)
        os.makedirs(self.out, exist_ok=True)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.started = time.time()  # this launch's records only: a relaunch appends to OUT's files
        self.mine = cfg.groups if cfg.groups is not None else list(range(cfg.replica_groups))
        self.groups: dict[int, list[Proc]] = {}
        self.incarnation: dict[int, int] = {}
        self.restarts: dict[int, int] = {g: 0 for g in self.mine}
        self.done: set[int] = set()
        self.late: set[int] = set()  # failed after another group had finished: not restarted
        self.user_error = False
        self.failed: dict[int, str] = {}
        self.events: list[dict] = []
        self.procs = ProcessTable(self.lock, self.stop)
        self.spares = SparePool(self.start_spare, cfg.ranks_per_group, cfg.spares, self.lock, self.stop)
        self.watch = Watch(self, faults.load(cfg.faults) if cfg.faults else [])
        self.host = LighthouseHost(cfg, self.out, self.log)
        self.lease = RunLease(self.out, self.mine, cfg.job_id)
        self.lease_lost: str | None = None

    # ---- what a rank runs (the subclass's hooks) ----------------------------------------
    def worker_argv(self, g: int) -> list[str]:
        """The arguments of every rank of group g."""
        return ["--out", self.out, *(["--shards", self.cfg.shards] if self.cfg.shards else []), *self.cfg.extra]

    def worker_module(self) -> str:
        """What `python -m` runs for a rank started cold."""
        return self.cfg.worker

    def spare_preload(self) -> list[str]:
        """Modules a warm spare imports besides the worker."""
        return []

    def start_spare(self) -> Proc:
        """A warm spare: a process that imports the worker and waits for its rank on stdin."""
        argv = [sys.executable, "-m", "ftcore.launcher.child", "spare", self.cfg.worker, *self.spare_preload()]
        return self.spawn(argv, self.base_env(), "spare", stdin=True)

    def after_kill(self) -> None:
        """Clean up what SIGKILLed ranks could not (after a group or the whole launch is killed)."""

    def finish(self, code: int) -> int:
        """The launch has ended with `code`; its records are complete. Returns the exit status."""
        return 1 if not code and not self.done else code

    # ---- logging and environment ----------------------------------------------------------
    def log(self, msg: str, **data) -> None:
        self.events.append({"t": time.time(), "kind": msg, **data})
        with self.lock:
            print(f"[launch] {msg} {json.dumps(data) if data else ''}".rstrip(), flush=True)

    @property
    def addr(self) -> str:
        return self.host.addr

    def base_env(self) -> dict[str, str]:
        # ranks read this job's token from its file (job_env), never the lighthouse's secret
        env = environment.inherited(without=("FTCORE_TOKEN", "FTCORE_TOKEN_FILE"))
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(self.job_env(), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
        if self.cfg.faults:
            env |= environment.RankEnv(faults=os.path.abspath(self.cfg.faults)).to_env()
        return env

    def told(self) -> environment.RankEnv:
        """What every rank of every group of this job is told, as on a cluster."""
        cfg = self.cfg
        return environment.RankEnv(
            lighthouse=self.addr,
            job=cfg.job_id,
            num_groups=cfg.replica_groups,
            min_replicas=cfg.min_replicas,
            lr_policy=cfg.lr_policy,
            token_file=self.host.job_token_file or None,
        )

    def job_env(self) -> dict[str, str]:
        env = self.told().to_env()
        if self.cfg.oversubscribe_gpus:
            env["FTREC_OVERSUBSCRIBE_GPUS"] = "1"
        return env

    def rank_env(self, g: int, k: int, inc: int, master_port: int) -> dict[str, str]:
        K = self.cfg.ranks_per_group
        told = dataclasses.replace(self.told(), group=g, incarnation=inc, rank=k, world=K)
        return {
            **told.to_env(),
            "LOCAL_RANK": str(k),
            "LOCAL_WORLD_SIZE": str(K),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
            "GROUP_RANK": str(g),
            "FTREC_OUT": os.path.join(self.out, f"replica_{g}"),
            # this host's GPUs are split over the groups run here: group slot s, K GPUs each
            "FTREC_GPU_SLOT": str(self.mine.index(g)),
            "FTREC_GPU_SLOTS": str(len(self.mine)),
        }

    def torchrun_command(self, g: int) -> str:
        """Replica group g as one torchrun job: what this launcher runs, for a cluster."""
        env = {**self.job_env(), **environment.RankEnv(group=g).to_env()}
        K, job = str(self.cfg.ranks_per_group), self.cfg.job_id
        argv = ["torchrun", "--nnodes", "1", "--nproc-per-node", K, "--rdzv-backend", "c10d"]
        argv += ["--rdzv-endpoint", "HOST:PORT", "--rdzv-id", f"{job}-g{g}", "--max-restarts"]
        argv += [str(self.cfg.max_restarts), "-m", self.worker_module(), *self.worker_argv(g)]
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, argv)])

    # ---- processes --------------------------------------------------------------------------
    def spawn(self, argv: list[str], env: dict[str, str], prefix: str, stdin: bool = False) -> Proc:
        """Every child process starts here, so that end_all can find it."""
        return self.procs.spawn(argv, env, prefix, stdin)

    def end_all(self) -> None:
        """SIGKILL every process this launch started that still runs (a group's ranks, a spare,
        the lighthouse): a stopped launch leaves nothing behind."""
        self.procs.kill_all()
        self.after_kill()

    def start_lighthouse(self) -> None:
        proc = self.spawn(self.host.argv(), self.base_env(), "lighthouse")
        self.host.wait_ready(proc)

    def status(self) -> dict | None:
        return self.host.status()

    def start_group(self, g: int, inc: int) -> list[Proc]:
        port = free_port()
        argv = self.worker_argv(g)
        spares = self.spares.take() if inc > 0 else None
        procs = []
        for k in range(self.cfg.ranks_per_group):
            env = self.rank_env(g, k, inc, port)
            if spares:
                p = spares[k]
                self.spares.assign(p, f"g{g}r{k}", env, argv)
            else:
                child = [sys.executable, "-m", "ftcore.launcher.child", "run", self.worker_module(), *argv]
                p = self.spawn(child, {**self.base_env(), **env}, f"g{g}r{k}")
            procs.append(p)
        self.groups[g], self.incarnation[g] = procs, inc
        self.log("group_started", group=g, incarnation=inc, spare=bool(spares), pids=[p.pid for p in procs])
        if spares:
            self.spares.refill_later(2.0)
        return procs

    def kill_group(self, g: int) -> None:
        for p in self.groups.get(g, []):
            p.kill()
        self.after_kill()

    # ---- supervision ------------------------------------------------------------------------
    def run_group_once(self, g: int, inc: int) -> None:
        if inc > 0 and self.done:
            # Another group already finished training: there is nobody left to heal from.
            self.log("group_not_restarted", group=g, reason="training already finished")
            self.late.add(g)
            return
        procs = self.start_group(g, inc)
        while not self.stop.is_set():
            codes = [p.p.poll() for p in procs]
            bad = [(k, c) for k, c in enumerate(codes) if c not in (None, 0)]
            if any(c == 2 for _, c in bad):
                # The worker's "user error" status (bad config or data): restarting cannot help.
                self.kill_group(g)
                self.log("group_user_error", group=g, incarnation=inc)
                self.failed[g] = f"group {g} exited with a usage error (status 2); see its log above"
                self.user_error = True
                self.stop.set()
                return
            if bad:
                self.kill_group(g)
                self.log("group_failed", group=g, incarnation=inc, exits={str(k): c for k, c in bad})
                raise GroupFailed(f"group {g} rank(s) {bad}")
            if procs[0].replace_group:
                self.kill_group(g)
                self.log("group_replaced", group=g, incarnation=inc, reason="unhealthy while alive")
                raise GroupFailed(f"group {g} hung")
            if all(c == 0 for c in codes):
                self.group_exited(g, inc)
                return
            time.sleep(0.01)

    def group_exited(self, g: int, inc: int) -> None:
        """Every rank of g exited 0: finished, or a restart that found the job finished."""
        if inc > 0 and self.final_state(g, since=self.started) is None:
            # a restart that found the job finished (JobFinished): nothing to heal from
            self.log("group_not_needed", group=g, incarnation=inc, reason="training finished first")
            self.late.add(g)
            return
        self.done.add(g)
        self.log("group_finished", group=g, incarnation=inc)

    def supervise(self, g: int) -> None:
        """Group g's attempts, restarted with exponential backoff up to --max-restarts."""
        attempts = 0
        try:
            for attempt in Retrying(
                stop=stop_after_attempt(self.cfg.max_restarts + 1),
                wait=wait_exponential(multiplier=self.cfg.backoff_s, max=10),
                retry=retry_if_exception_type(GroupFailed),
                reraise=False,
            ):
                with attempt:
                    inc = attempts
                    attempts += 1
                    self.restarts[g] = inc
                    self.run_group_once(g, inc)
        except RetryError:
            self.failed[g] = f"group {g} failed {attempts} times (--max-restarts {self.cfg.max_restarts})"
            self.log("group_gave_up", group=g, attempts=attempts)
            self.stop.set()

    # ---- the run folder's lease --------------------------------------------------------------
    def claim(self) -> None:
        """Take the run folder's lease on our groups (LeaseHeld while another launcher's job lives
        there), then write the files a job owns (tokens)."""
        me = self.lease.acquire()
        for taken in self.lease.taken_over:
            self.log("lease_taken_over", stale=taken)
        self.log("lease", folder=self.lease.folder, groups=self.mine, pid=me.pid, host=me.host, session=me.session)
        self.host.write_tokens()

    def keep_lease(self) -> None:
        """The lease's heartbeat; a lease another launcher took over (this one was presumed dead:
        paused or cut off beyond FTCORE_RUN_LEASE_STALE) stops the launch at once."""
        while not self.stop.wait(timeouts.RUN_LEASE_HEARTBEAT):
            try:
                lost = self.lease.beat()
            except OSError as e:
                self.log("warning", message=f"lease heartbeat not written: {e}")
                continue
            if lost:
                self.lease_lost = lost
                self.log("lease_lost", reason=lost)
                self.stop.set()
                self.end_all()
                return

    # ---- the run ----------------------------------------------------------------------------
    def run(self) -> int:
        """The launch: claim the run folder, run every group to its end, let go of the folder."""
        self.claim()
        try:
            return self._run()
        finally:
            self.lease.release()

    def _run(self) -> int:
        threading.Thread(target=self.keep_lease, daemon=True).start()
        if self.cfg.lighthouse is None:
            self.start_lighthouse()
        self.log(
            "launch",
            lighthouse=self.addr,
            groups=self.cfg.replica_groups,
            ranks=self.cfg.ranks_per_group,
            worker=self.cfg.worker,
            out=self.out,
        )
        sups = [threading.Thread(target=self.supervise, args=(g,), daemon=True) for g in self.mine]
        for t in sups:
            t.start()
        threading.Thread(target=self.spares.refill, daemon=True).start()
        threading.Thread(target=self.watch.run, daemon=True).start()
        deadline = self.t0 + self.cfg.timeout
        while any(t.is_alive() for t in sups) and time.monotonic() < deadline and not self.stop.is_set():
            time.sleep(0.05)
        timed_out = time.monotonic() >= deadline
        self.stop.set()
        for g in list(self.groups):
            if g not in self.done:
                self.kill_group(g)
        self.spares.kill_all()
        if self.host.proc is not None:
            self.host.proc.kill()
        code = 0
        if timed_out:
            self.log("timeout", seconds=self.cfg.timeout)
            code = 1
        if self.failed:
            code = 2 if self.user_error else 1
        if self.lease_lost:
            return 1  # the folder is another launcher's now: its records are not ours to write
        return self.finish(code)

    def final_state(self, g: int, since: float | None = None) -> list[str] | None:
        """The group's final state files in rank order, or None if it has none (or lacks a
        rank's file that rank 0's metadata announces: the state is incomplete; or, with
        `since`, its file is older than that: an earlier launch's)."""
        folder = os.path.join(self.out, f"replica_{g}")
        first = os.path.join(folder, final_state_mod.file_name(0))
        if since is not None and os.path.exists(first) and os.path.getmtime(first) < since:
            return None
        if not os.path.exists(first):
            legacy = os.path.join(folder, "final.safetensors")
            return [legacy] if os.path.exists(legacy) else None
        try:
            meta = final_state_mod.metadata(first)
            ranks = int(meta.get("ranks", "1"))
            # Only the files rank 0 announces: a stale state.rank<k> from an earlier sharded run
            # in the same folder is not part of this run's state.
            paths = [first, *(os.path.join(folder, final_state_mod.file_name(k)) for k in range(1, ranks))]
            missing = [p for p in paths if not os.path.exists(p)]
            if missing:
                print(
                    f"[launch] replica_{g}: final state incomplete, {len(missing)} of {ranks} rank file(s) "
                    f"missing ({missing[0]})",
                    flush=True,
                )
                return None
            stale = [p for p in paths[1:] if final_state_mod.metadata(p).get("step") != meta.get("step")]
            if stale:
                print(
                    f"[launch] replica_{g}: final state incomplete, {stale[0]} is from another step than "
                    f"{first} (step {meta.get('step')})",
                    flush=True,
                )
                return None
        except (OSError, ValueError) as e:
            print(f"[launch] replica_{g}: cannot read its final state: {e}", flush=True)
            return None
        return paths
