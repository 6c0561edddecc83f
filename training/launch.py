"""The replica-group launcher: R groups x K ranks on ftcore, restarted group by group.

    python -m training launch --shards DIR --replica-groups R --ranks-per-group K \
        [--lighthouse HOST:PORT --job-id ID] [--groups 0,1] [--faults PLAN] [--out DIR] [-- trainer args]

A local convenience over the cluster layout (README, "Running on a cluster"): each replica
group is one torchrun-equivalent process group, with exactly the environment that
`torchrun ... -m training train` gets there (`torchrun_command` prints it).

- starts a lighthouse (python -m ftcore.lighthouse) unless one is given, with a fresh
  admin secret in OUT/token, and restarts it if it dies; a given (standing) lighthouse is
  reached with the token this process was given (FTCORE_TOKEN_FILE or FTCORE_TOKEN); the
  ranks get only the job's own token (OUT/job-token, ftcore/auth.py);
- starts replica groups (all R, or the --groups this host runs) of K processes (torchrun's
  environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT per group) plus the ftcore
  environment (ftcore.manager.ENV);
- gives every rank its own GPU when there are GPUs: the groups this launcher runs split the
  host's GPUs, group slot s taking GPUs s*K .. s*K+K-1 (FTREC_GPU_SLOT/FTREC_GPU_SLOTS, read by
  training/distributed.py `rank_device`); too few GPUs is an error unless --oversubscribe-gpus;
- keeps K spare processes that have already imported torch and the trainer, so a failed
  group is back in well under a second (a cold start spends seconds in imports);
- restarts a failed group (any rank exits non-zero or dies) with tenacity backoff, up
  to --max-restarts; replaces a group the lighthouse has seen unhealthy for
  --replace-after seconds while its processes live on (a hang);
- runs the external part of a fault plan (ftcore/faults.py): signals at a step or time,
  lighthouse kills; the in-process part reaches the ranks through FTCORE_FAULTS;
- prefixes every log line with [g<group>r<rank>]; exits non-zero if training cannot finish;
- at the end prints a checksum of every group's final state (OUT/replica_<g>/: every
  rank's file when the ranks' states differ, a sharded item table) and writes
  OUT/timeline.json (lighthouse events + every step attempt of every rank), logged to
  MLflow through training.tracking when the trainer's run is known.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from dataprep.fsutil import atomic_write_json
from ftcore import auth, final_state
from ftcore import faults as faults_mod
from ftcore.lighthouse_client import call
from training.ports import free_port

TOY = "ftcore.examples.toy"
SHM_DIR = "/dev/shm"  # comm.transport=smfree's default shm_dir
TRAINER = "training.__main__"


class LaunchError(RuntimeError):
    """A user-fixable launcher error: one line, no traceback."""


class GroupFailed(RuntimeError):
    pass


@dataclass
class LaunchConfig:
    shards: str | None = None
    replica_groups: int = 2
    ranks_per_group: int = 1
    lighthouse: str | None = None
    job_id: str = "default"
    groups: list[int] | None = None  # the replica groups this launcher runs (None: all R)
    faults: str | None = None
    out: str = "work/launch"
    worker: str = TRAINER
    min_replicas: int = 1
    max_restarts: int = 5
    backoff_s: float = 0.1
    replace_after: float = 15.0
    timeout: float = 3600.0
    spares: bool = True
    lr_policy: str = "sqrt"
    extra: list[str] = field(default_factory=list)
    print_commands: bool = False
    oversubscribe_gpus: bool = False  # groups may share GPUs (never two ranks of one group)


class Proc:
    """A child process whose output is copied line by line with a prefix."""

    def __init__(
        self, argv: list[str], env: dict[str, str], prefix: str, out_lock: threading.Lock, stdin: bool = False
    ):
        self.prefix = prefix
        self.p = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            start_new_session=True,
            text=True,
            bufsize=1,
        )
        self.ready = threading.Event()
        self.replace_group = False  # its group is unhealthy while alive (a hang): kill and restart it
        self.planned_kill = False  # killed by the fault plan (kill_lighthouse): not a death to repair
        self._lock = out_lock
        threading.Thread(target=self._pump, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.p.pid

    def send(self, line: str) -> None:
        """A line on its stdin (a spare's assignment)."""
        if self.p.stdin is None:
            raise RuntimeError(f"{self.prefix}: started without a stdin pipe")
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def _pump(self) -> None:
        if self.p.stdout is None:  # Popen(stdout=PIPE) always has it
            return
        for line in self.p.stdout:
            if line.startswith("ftrec-spare-ready"):
                self.ready.set()
                continue
            with self._lock:
                sys.stdout.write(f"[{self.prefix}] {line}" if line.endswith("\n") else f"[{self.prefix}] {line}\n")
                sys.stdout.flush()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.p.pid, sig)  # its own session: the rank and anything it started
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        try:
            self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class Launcher:
    def __init__(self, cfg: LaunchConfig):
        self.cfg = cfg
        self.out = os.path.abspath(cfg.out)
        os.makedirs(self.out, exist_ok=True)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.started = time.time()  # this launch's records only: a relaunch appends to OUT's files
        self.groups: dict[int, list[Proc]] = {}
        self.children: list[Proc] = []  # the processes this launch started that may still run (end_all)
        self.spawn_lock = threading.Lock()
        self.mine = cfg.groups if cfg.groups is not None else list(range(cfg.replica_groups))
        self.incarnation: dict[int, int] = {}
        self.restarts: dict[int, int] = {g: 0 for g in self.mine}
        self.done: set[int] = set()
        self.late: set[int] = set()  # failed after another group had finished: not restarted
        self.user_error = False
        self.failed: dict[int, str] = {}
        self.spares: list[Proc] = []
        self.lighthouse_proc: Proc | None = None
        self.events: list[dict] = []
        self.faults = faults_mod.load(cfg.faults) if cfg.faults else []
        # Our own lighthouse gets a fresh admin secret in OUT/token; a standing one is reached with
        # the token we were given (its admin secret or this job's token). Ranks get only this
        # job's token (OUT/job-token): it opens this job's routes and heal servers, nothing else.
        self.token_file: str | None = None
        if cfg.lighthouse is None:
            self.token_file = os.path.join(self.out, "token")
            self.token: str | None = auth.write_token_file(self.token_file)
        else:
            self.token = auth.token_from_env()
            if self.token is None:
                self.log(
                    "warning",
                    message=f"no FTCORE_TOKEN_FILE or FTCORE_TOKEN for lighthouse {cfg.lighthouse}: "
                    "only a lighthouse started with --insecure will accept the ranks",
                )
        self.job_token_file: str | None = None
        if self.token is not None:
            try:
                job_token = auth.job_token(self.token, cfg.job_id)
            except ValueError as e:
                raise LaunchError(f"FTCORE_TOKEN_FILE / FTCORE_TOKEN: {e}") from None
            self.job_token_file = os.path.join(self.out, "job-token")
            auth.write_token_file(self.job_token_file, job_token)
        self.addr = cfg.lighthouse or f"127.0.0.1:{free_port()}"
        self.status_path = "/status?" + urllib.parse.urlencode({"job": cfg.job_id})

    # ---- logging ------------------------------------------------------------------
    def log(self, msg: str, **data) -> None:
        self.events.append({"t": time.time(), "kind": msg, **data})
        with self.lock:
            print(f"[launch] {msg} {json.dumps(data) if data else ''}".rstrip(), flush=True)

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("FTCORE_TOKEN", None)  # ranks read this job's token from its file (job_env), nothing else
        env.pop("FTCORE_TOKEN_FILE", None)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(self.job_env(), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
        if self.cfg.faults:
            env["FTCORE_FAULTS"] = os.path.abspath(self.cfg.faults)
        return env

    def job_env(self) -> dict[str, str]:
        """What every rank of every group of this job gets (ftcore.manager.ENV), as on a cluster."""
        env = {
            "FTCORE_LIGHTHOUSE": self.addr,
            "FTCORE_JOB_ID": self.cfg.job_id,
            "FTREC_NUM_REPLICA_GROUPS": str(self.cfg.replica_groups),
            "FTCORE_MIN_REPLICAS": str(self.cfg.min_replicas),
            "FTCORE_LR_POLICY": self.cfg.lr_policy,
        }
        if self.job_token_file:
            env["FTCORE_TOKEN_FILE"] = self.job_token_file
        if self.cfg.oversubscribe_gpus:
            env["FTREC_OVERSUBSCRIBE_GPUS"] = "1"
        return env

    def torchrun_command(self, g: int) -> str:
        """Replica group g as one torchrun job: what this launcher runs, for a cluster."""
        import shlex

        env = {**self.job_env(), "FTREC_REPLICA_GROUP": str(g)}
        argv = [
            "torchrun",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(self.cfg.ranks_per_group),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "HOST:PORT",
            "--rdzv-id",
            f"{self.cfg.job_id}-g{g}",
            "--max-restarts",
            str(self.cfg.max_restarts),
            "-m",
            "training",
            *self.worker_argv(g),
        ]
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, argv)])

    # ---- lighthouse -----------------------------------------------------------------
    def start_lighthouse(self) -> None:
        if self.token_file is None:
            raise LaunchError("the launcher starts a lighthouse only with a token file of its own (OUT/token)")
        argv = [
            sys.executable,
            "-m",
            "training.launch",
            "--child",
            "ftcore.lighthouse",
            "--bind",
            self.addr,
            "--min-replicas",
            str(self.cfg.min_replicas),
            "--expected-replicas",
            str(self.cfg.replica_groups),
            "--token-file",
            self.token_file,
            "--events-file",
            os.path.join(self.out, "lighthouse-events.jsonl"),
        ]
        self.lighthouse_proc = self.spawn(argv, self.base_env(), "lighthouse")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.lighthouse_proc.p.poll() is not None:
                raise LaunchError(
                    f"the lighthouse exited with status {self.lighthouse_proc.p.returncode} (is {self.addr} in use?)"
                )
            try:
                if call(self.addr, self.status_path, None, self.token, method="GET", timeout=1)[0] == 200:
                    return
            except OSError:
                time.sleep(0.05)
        raise LaunchError(f"the lighthouse did not answer on {self.addr} within 30s")

    def status(self) -> dict | None:
        try:
            code, body = call(self.addr, self.status_path, None, self.token, method="GET", timeout=1)
            return body if code == 200 else None
        except OSError:
            return None

    # ---- processes ------------------------------------------------------------------
    def worker_argv(self, g: int) -> list[str]:
        if self.cfg.worker == TRAINER:
            return [
                "train",
                "--shards",
                self.cfg.shards or "",
                "--out",
                os.path.join(self.out, f"replica_{g}"),
                *self.cfg.extra,
            ]
        return ["--out", self.out, *(["--shards", self.cfg.shards] if self.cfg.shards else []), *self.cfg.extra]

    def rank_env(self, g: int, k: int, inc: int, master_port: int) -> dict[str, str]:
        K = self.cfg.ranks_per_group
        return {
            "FTREC_REPLICA_GROUP": str(g),
            "FTCORE_INCARNATION": str(inc),
            "RANK": str(k),
            "LOCAL_RANK": str(k),
            "WORLD_SIZE": str(K),
            "LOCAL_WORLD_SIZE": str(K),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
            "GROUP_RANK": str(g),
            "FTREC_OUT": os.path.join(self.out, f"replica_{g}"),
            # this host's GPUs are split over the groups run here: group slot s, K GPUs each
            "FTREC_GPU_SLOT": str(self.mine.index(g)),
            "FTREC_GPU_SLOTS": str(len(self.mine)),
        }

    def spawn(self, argv: list[str], env: dict[str, str], prefix: str, stdin: bool = False) -> Proc:
        """Every child process starts here, so that end_all can find it."""
        with self.spawn_lock:
            self.children = [c for c in self.children if c.p.poll() is None]
            p = Proc(argv, env, prefix, self.lock, stdin=stdin)
            self.children.append(p)
        if self.stop.is_set():  # started by a supervisor thread while the launch was ending
            p.kill()
        return p

    def end_all(self) -> None:
        """SIGKILL every process this launch started that still runs, whatever list it is on
        now (a group's ranks, a spare, the lighthouse): a stopped launch leaves nothing behind."""
        with self.spawn_lock:
            alive = [c for c in self.children if c.p.poll() is None]
        for p in alive:
            p.kill()
        from training.comm import shm  # a SIGKILLed rank cannot remove its shared-memory outboxes

        shm.sweep(SHM_DIR)

    def start_spare(self) -> Proc:
        argv = [sys.executable, "-m", "training.launch", "--spare", self.cfg.worker]
        return self.spawn(argv, self.base_env(), "spare", stdin=True)

    def refill_spares(self, delay: float = 0.0) -> None:
        # After a restart, wait: a new spare's imports would compete with the heal for CPU.
        if self.stop.wait(delay):
            return
        if self.cfg.spares and not self.stop.is_set():
            with self.lock:
                need = 2 * self.cfg.ranks_per_group - len(self.spares)  # two failures in a row
            for _ in range(max(need, 0)):
                p = self.start_spare()
                with self.lock:
                    self.spares.append(p)

    def take_spares(self) -> list[Proc] | None:
        with self.lock:
            ready = [p for p in self.spares if p.ready.is_set() and p.p.poll() is None]
            if len(ready) < self.cfg.ranks_per_group:
                return None
            take = ready[: self.cfg.ranks_per_group]
            self.spares = [p for p in self.spares if p not in take]
            return take

    def start_group(self, g: int, inc: int) -> list[Proc]:
        port = free_port()
        argv = self.worker_argv(g)
        spares = self.take_spares() if inc > 0 else None
        procs = []
        for k in range(self.cfg.ranks_per_group):
            env = self.rank_env(g, k, inc, port)
            if spares:
                p = spares[k]
                p.prefix = f"g{g}r{k}"
                p.send(json.dumps({"env": env, "argv": argv}))
            else:
                module = self.cfg.worker if self.cfg.worker != TRAINER else "training"
                child = [sys.executable, "-m", "training.launch", "--child", module, *argv]
                p = self.spawn(child, {**self.base_env(), **env}, f"g{g}r{k}")
            procs.append(p)
        self.groups[g], self.incarnation[g] = procs, inc
        self.log("group_started", group=g, incarnation=inc, spare=bool(spares), pids=[p.pid for p in procs])
        if spares:
            threading.Thread(target=self.refill_spares, args=(2.0,), daemon=True).start()
        return procs

    def kill_group(self, g: int) -> None:
        for p in self.groups.get(g, []):
            p.kill()
        # a SIGKILLed rank cannot remove its shared-memory outboxes (comm.transport=smfree)
        from training.comm import shm

        shm.sweep(SHM_DIR)

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
                # The trainer's "user error" status (bad config or data): restarting cannot help.
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
                if inc > 0 and self.final_state(g, since=self.started) is None:
                    # a restart that found the job finished (JobFinished): nothing to heal from
                    self.log("group_not_needed", group=g, incarnation=inc, reason="training finished first")
                    self.late.add(g)
                    return
                self.done.add(g)
                self.log("group_finished", group=g, incarnation=inc)
                return
            time.sleep(0.01)

    def supervise(self, g: int) -> None:
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

    # ---- faults and hangs -----------------------------------------------------------
    def watch(self) -> None:
        """External faults, a dead lighthouse, hung groups."""
        unhealthy_since: dict[int, float] = {}
        while not self.stop.wait(0.02):
            st = self.status()
            now = time.monotonic()
            lh = self.lighthouse_proc
            if lh is not None and lh.p.poll() is not None and not lh.planned_kill:
                self.log("lighthouse_died", code=lh.p.returncode)
                self.start_lighthouse()
                continue
            steps = {gr["group"]: gr["step"] for gr in (st or {}).get("groups", [])}
            for f in self.faults:
                if f.fired or f.in_process:
                    continue
                inc = self.incarnation.get(f.group)
                if f.kind not in faults_mod.LIGHTHOUSE_KINDS and inc != f.incarnation:
                    continue
                # a lighthouse fault's step is the job's, any other fault's its group's
                step = (
                    max(steps.values(), default=0) if f.kind in faults_mod.LIGHTHOUSE_KINDS else steps.get(f.group, -1)
                )
                due = (f.at_time is not None and now - self.t0 >= f.at_time) or (
                    f.at_step is not None and step >= f.at_step
                )
                if due:
                    f.fired = True
                    threading.Thread(target=self.fire, args=(f,), daemon=True).start()
            if st:
                for gr in st["groups"]:
                    g = gr["group"]
                    alive = g in self.groups and all(p.p.poll() is None for p in self.groups[g]) and g not in self.done
                    if alive and not gr["healthy"] and not gr["left"] and gr["incarnation"] == self.incarnation.get(g):
                        unhealthy_since.setdefault(g, now)
                        if now - unhealthy_since[g] > self.cfg.replace_after:
                            self.groups[g][0].replace_group = True
                            unhealthy_since.pop(g)
                    else:
                        unhealthy_since.pop(g, None)

    def fire(self, f: faults_mod.Fault) -> None:
        lh = self.lighthouse_proc
        if f.kind in faults_mod.LIGHTHOUSE_KINDS and lh is None:
            self.log("fault_skipped", fault=f.kind, reason="the lighthouse was not started here")
            return
        if f.kind == "pause_lighthouse" and lh is not None:
            self.log("fault", fault="pause_lighthouse", pid=lh.pid, seconds=f.duration_s)
            lh.signal(signal.SIGSTOP)
            time.sleep(f.duration_s)
            lh.signal(signal.SIGCONT)
            self.log("fault_resumed", fault="pause_lighthouse")
            return
        if f.kind == "kill_lighthouse" and lh is not None:
            lh.planned_kill = True
            self.log("fault", fault="kill_lighthouse", pid=lh.pid)
            lh.kill()
            time.sleep(f.duration_s)
            self.start_lighthouse()
            self.log("lighthouse_restarted")
            return
        procs = self.groups.get(f.group, [])
        targets = procs if f.rank == "all" else procs[int(f.rank) : int(f.rank) + 1]
        sig = signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP
        for p in targets:
            self.log("fault", fault=f.kind, group=f.group, rank=f.rank, pid=p.pid)
            p.signal(sig)
        if f.kind == "stop" and f.duration_s > 0:
            time.sleep(f.duration_s)
            for p in targets:
                p.signal(signal.SIGCONT)
            self.log("fault_resumed", fault="stop", group=f.group)

    # ---- the run ----------------------------------------------------------------------
    def run(self) -> int:
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
        threading.Thread(target=self.refill_spares, daemon=True).start()
        watcher = threading.Thread(target=self.watch, daemon=True)
        watcher.start()
        deadline = self.t0 + self.cfg.timeout
        while any(t.is_alive() for t in sups) and time.monotonic() < deadline and not self.stop.is_set():
            time.sleep(0.05)
        timed_out = time.monotonic() >= deadline
        self.stop.set()
        for g in list(self.groups):
            if g not in self.done:
                self.kill_group(g)
        for p in self.spares:
            p.kill()
        if self.lighthouse_proc is not None:
            self.lighthouse_proc.kill()
        code = 0
        if timed_out:
            self.log("timeout", seconds=self.cfg.timeout)
            code = 1
        if self.failed:
            code = 2 if self.user_error else 1
        sums = self.report()
        if not code and (not self.done or len(sums) < len(self.done)):
            code = 1
        self.write_timeline(sums, code)
        return code

    def final_state(self, g: int, since: float | None = None) -> list[str] | None:
        """The group's final state files in rank order, or None if it has none (or lacks a
        rank's file that rank 0's metadata announces: the state is incomplete; or, with
        `since`, its file is older than that: an earlier launch's)."""
        folder = os.path.join(self.out, f"replica_{g}")
        first = os.path.join(folder, final_state.file_name(0))
        if since is not None and os.path.exists(first) and os.path.getmtime(first) < since:
            return None
        if not os.path.exists(first):
            legacy = os.path.join(folder, "final.safetensors")
            return [legacy] if os.path.exists(legacy) else None
        try:
            meta = final_state.metadata(first)
            ranks = int(meta.get("ranks", "1"))
            # Only the files rank 0 announces: a stale state.rank<k> from an earlier sharded run
            # in the same folder is not part of this run's state.
            paths = [first, *(os.path.join(folder, final_state.file_name(k)) for k in range(1, ranks))]
            missing = [p for p in paths if not os.path.exists(p)]
            if missing:
                print(
                    f"[launch] replica_{g}: final state incomplete, {len(missing)} of {ranks} rank file(s) "
                    f"missing ({missing[0]})",
                    flush=True,
                )
                return None
            stale = [p for p in paths[1:] if final_state.metadata(p).get("step") != meta.get("step")]
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

    def report(self) -> dict[int, str]:
        """A checksum of every group's final state (all its rank files); warns when they differ."""
        sums = {}
        for g in self.mine:
            paths = self.final_state(g)
            if paths:
                sums[g] = final_state.checksum(paths)
                where = paths[0] if len(paths) == 1 else f"{paths[0]} + {len(paths) - 1} rank file(s)"
                print(
                    f"[launch] replica_{g} checksum {sums[g]} ({where}), restarts {self.restarts.get(g, 0)}", flush=True
                )
        if len(set(sums.values())) > 1:
            print("[launch] WARNING: replica groups ended with different states", flush=True)
        return sums

    def write_timeline(self, sums: dict[int, str], code: int) -> None:
        events = []
        lh_file = os.path.join(self.out, "lighthouse-events.jsonl")
        if os.path.exists(lh_file):
            with open(lh_file) as f:
                events = [json.loads(line) for line in f if line.strip().startswith("{")]
        elif self.cfg.lighthouse:  # a standing lighthouse: its recent events of this job
            events = (self.status() or {}).get("events", [])
        steps = []
        for root, _, files in os.walk(self.out):
            for name in files:
                if name.endswith(".jsonl") and os.path.basename(root) == "records":
                    with open(os.path.join(root, name)) as f:
                        for line in f:
                            try:
                                steps.append(json.loads(line))
                            except json.JSONDecodeError:
                                pass
        # A relaunch into the same OUT (an Airflow retry) appends to the files of the earlier
        # attempts: the timeline is this launch's.
        events = [e for e in events if e.get("t", 0) >= self.started]
        steps = [s for s in steps if s.get("t", 0) >= self.started]
        summary = {**summarize(events + self.events, steps), **per_group(events, steps, self.restarts)}
        timeline = {
            "exit_code": code,
            "checksums": {str(g): s for g, s in sums.items()},
            "restarts": self.restarts,
            "summary": summary,
            "launcher_events": self.events,
            "lighthouse_events": events,
            "steps": sorted(steps, key=lambda r: r["t"]),
        }
        atomic_write_json(os.path.join(self.out, "timeline.json"), timeline)
        print(f"[launch] timeline {os.path.join(self.out, 'timeline.json')}: {json.dumps(summary)}", flush=True)
        log_to_mlflow(self.out, summary, os.path.join(self.out, "timeline.json"))


def summarize(events: list[dict], steps: list[dict]) -> dict:
    """Recovery figures from the events and step records (pure data; MLflow-free)."""
    fails = [e["t"] for e in events if e["kind"] in ("failure_detected",)]
    quorums = [e for e in events if e["kind"] == "quorum_formed"]
    heals = [e for e in events if e["kind"] == "heal_finished"]
    committed = [s for s in steps if s.get("committed")]
    return {
        "failures_detected": len(fails),
        "quorum_changes": len(quorums),
        "heals": len(heals),
        "step_attempts": len(steps),
        "failed_attempts": sum(1 for s in steps if not s.get("committed")),
        "committed_steps": len({s["step"] for s in committed}),
        "mean_participants": (sum(s["participants"] for s in committed) / len(committed)) if committed else 0.0,
    }


def per_group(events: list[dict], steps: list[dict], restarts: dict[int, int]) -> dict:
    """Each replica group's own facts, as `group<g>/...` (the job's one MLflow run holds them)."""
    out = {}
    for g, n in sorted(restarts.items()):
        out[f"group{g}/restarts"] = n
        out[f"group{g}/committed_steps"] = len({s["step"] for s in steps if s.get("group") == g and s.get("committed")})
        out[f"group{g}/heals"] = sum(
            1 for e in events if e.get("kind") == "heal_finished" and e.get("group") == g and e.get("rank", 0) == 0
        )
        out[f"group{g}/slow_exclusions"] = sum(
            1 for e in events if e.get("kind") == "group_excluded" and e.get("group") == g
        )
    return out


def log_to_mlflow(out: str, summary: dict, timeline: str) -> None:
    """Recovery metrics and the timeline on the trainer's MLflow run, when there is one."""
    result = os.path.join(out, "replica_0", "result.json")
    if not os.path.exists(result):
        return
    try:
        with open(result) as f:
            res = json.load(f)
        if not res.get("mlflow_run_id") or not res.get("tracking_uri"):
            return
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=res["tracking_uri"])
        for k, v in summary.items():
            client.log_metric(res["mlflow_run_id"], k if k.startswith("group") else f"ft/{k}", float(v))
        client.log_artifact(res["mlflow_run_id"], timeline)
        from training import timeline as timeline_chart

        chart = os.path.join(out, "timeline.png")  # committed steps per group, faults and heals marked
        with open(timeline) as f:
            if timeline_chart.png(json.load(f), chart):
                client.log_artifact(res["mlflow_run_id"], chart)
    except Exception as e:  # tracking is best effort; the run itself succeeded
        print(f"[launch] could not log recovery events to MLflow: {e}", flush=True)


def _die_with_parent() -> None:
    """Children live in their own sessions (so one rank can be signalled alone), which means
    a killed launcher would leave them running: each child watches its parent instead."""
    ppid = os.getppid()

    def watch() -> None:
        while os.getppid() == ppid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="die-with-launcher").start()


def _child(argv: list[str]) -> int:
    """Run `python -m MODULE ARGS` as a child that ends when the launcher ends."""
    import runpy

    _die_with_parent()
    sys.argv = [argv[0], *argv[1:]]
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    return 0


def _spare(worker: str) -> int:
    """A warm process: imports done, waits for its group assignment on stdin, then runs."""
    import importlib

    _die_with_parent()

    import torch  # the point: pay for imports and lazy initialisation before a failure

    mod = importlib.import_module(worker)
    if worker == TRAINER:
        importlib.import_module("training.train")
    # First use of an optimizer, autograd and gloo pulls in more modules (seconds here).
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.zeros(2, 4)).sum().backward()
    opt.step()
    import datetime

    import torch.distributed as dist

    from ftcore import netaddr

    fd, port = netaddr.listen_fd("127.0.0.1")
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=fd)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, absent from the stubs
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=5)
    dist.ProcessGroupGloo(dist.PrefixStore("warm", store), 0, 1, opts)
    del store
    print("ftrec-spare-ready", flush=True)
    line = sys.stdin.readline()
    if not line:
        return 0
    msg = json.loads(line)
    os.environ.update(msg["env"])
    return int(mod.main(msg["argv"]) or 0)


def parse(argv: list[str]) -> LaunchConfig:
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="python -m training launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", help="shard set (python -m dataprep shards)")
    p.add_argument("--replica-groups", type=int, default=2, help="R: replica groups (units of failure)")
    p.add_argument("--ranks-per-group", type=int, default=1, help="K: ranks per replica group")
    p.add_argument(
        "--lighthouse",
        help="HOST:PORT of a standing lighthouse (default: start one here); its token "
        "comes from FTCORE_TOKEN_FILE or FTCORE_TOKEN",
    )
    p.add_argument(
        "--job-id",
        default=os.environ.get("FTCORE_JOB_ID") or "default",
        help="this job's id on the lighthouse (jobs sharing a standing lighthouse need distinct ids)",
    )
    p.add_argument(
        "--groups",
        help="comma-separated replica groups this launcher runs (default: all of "
        "0..R-1; the others run elsewhere against the same --lighthouse)",
    )
    p.add_argument(
        "--print-commands",
        action="store_true",
        help="print each replica group as one torchrun command (for a cluster) and exit",
    )
    p.add_argument("--faults", help="fault plan, TOML or JSON (see ftcore/faults.py)")
    p.add_argument("--out", default="work/launch", help="output folder: replica_<g>/, timeline.json, ledger/")
    p.add_argument(
        "--worker",
        default=TRAINER,
        help=f"module with main(argv) run by each rank (default: the trainer; {TOY} is a self-contained toy)",
    )
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-restarts", type=int, default=5, help="per group")
    p.add_argument(
        "--replace-after",
        type=float,
        default=15.0,
        help="seconds a live group may stay unhealthy before it is killed and restarted",
    )
    p.add_argument("--lr-policy", choices=("none", "linear", "sqrt"), default="sqrt")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up (non-zero exit) after this many seconds")
    p.add_argument("--no-spares", action="store_true", help="restart groups cold (for benchmarks)")
    p.add_argument(
        "--oversubscribe-gpus",
        action="store_true",
        help="let replica groups share GPUs when the host has fewer than groups x ranks (tests, "
        "one-GPU checks); the ranks of one group always get distinct GPUs",
    )
    a = p.parse_args(argv)
    if a.replica_groups < 1 or a.ranks_per_group < 1:
        raise LaunchError("--replica-groups and --ranks-per-group must be >= 1")
    groups = None
    if a.groups:
        try:
            groups = sorted({int(g) for g in a.groups.split(",") if g.strip()})
        except ValueError:
            raise LaunchError(f"--groups {a.groups!r}: give comma-separated group ids, for example 0,2") from None
        if not groups or not all(0 <= g < a.replica_groups for g in groups):
            raise LaunchError(f"--groups {a.groups}: every id must be in 0..{a.replica_groups - 1} (--replica-groups)")
        if a.lighthouse is None and len(groups) < a.replica_groups:
            raise LaunchError("--groups runs part of the job: give the --lighthouse the other groups use")
    from ftcore.messages import JOB_ID

    if not JOB_ID.fullmatch(a.job_id):
        raise LaunchError(f"--job-id {a.job_id!r}: use letters, digits and ._:/+@=- (up to 128, FTCORE_JOB_ID)")
    if a.worker == TRAINER and not a.shards:
        raise LaunchError("--shards is required to launch the trainer (a folder from `python -m dataprep shards`)")
    if a.shards and not os.path.isfile(os.path.join(a.shards, "manifest.json")):
        raise LaunchError(f"--shards {a.shards}: no manifest.json there; build it with `python -m dataprep shards`")
    return LaunchConfig(
        a.shards,
        a.replica_groups,
        a.ranks_per_group,
        a.lighthouse,
        a.job_id,
        groups,
        a.faults,
        a.out,
        a.worker,
        a.min_replicas,
        a.max_restarts,
        0.1,
        a.replace_after,
        a.timeout,
        not a.no_spares,
        a.lr_policy,
        extra,
        a.print_commands,
        oversubscribe_gpus=a.oversubscribe_gpus,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--spare"]:
        return _spare(argv[1])
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    try:
        cfg = parse(argv)
        launcher = Launcher(cfg)
    except (LaunchError, faults_mod.PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.print_commands:
        for g in launcher.mine:
            print(launcher.torchrun_command(g))
        return 0
    try:
        return launcher.run()
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        launcher.stop.set()
        launcher.end_all()
        return 2
    except KeyboardInterrupt:
        launcher.stop.set()
        launcher.end_all()
        return 130


if __name__ == "__main__":
    sys.exit(main())
