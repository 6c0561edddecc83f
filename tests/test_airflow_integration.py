"""The production tier: ftrec_train end to end on Airflow as a platform team runs it, with three
kills mid-training.

PostgreSQL (a fresh cluster, tests/production_tier.py) is Airflow's metadata database and the
backend store of an MLflow tracking server; the API server, DAG processor, scheduler and triggerer
are separate processes (LocalExecutor), everything on 127.0.0.1 on free ports; the `ftrec_mlflow`
connection points the DAG at the MLflow server. Airflow notices a lost task in seconds here
(heartbeat and orphan timeouts: TIMEOUTS), not minutes. The test logs in through the REST API and
triggers one run of ftrec_train; while its `train` task trains (STEPS steps on 2 replica groups,
paced by a `slow` fault to at least STEP_S each; group 1 is killed at step 4 by the fault plan and
the launcher restarts it) it kills, one after the other:

  b. the task runner (kill -9 of the process that runs the train task, the launcher's parent);
  a. the supervisor of the next try (kill -9 of the LocalExecutor worker that runs it);
  c. the scheduler (kill -9), and starts a new one SCHEDULER_DOWN_S later.

Verdicts: each later try follows the job the first try started (its log says so); the run ends
`success`; one launcher, started once, trained every step once (each step committed once in the
ledger, none redone, STEPS in all; the train task's ledger check passed); one MLflow run with one
train/loss point per logged step; one registered model version, champion only once the test
approves it (param champion_approval: Airflow's human-in-the-loop task, answered over REST); the
task links and the plugin's page as before. Every process it started is stopped by its PID or
group at the end, and the figures (time to detect each kill, to follow) are printed and kept in
the test's folder. Then, on the same tier, the finished run in a real browser
(test_the_run_in_a_real_browser): the Lighthouse tab, a task's log, the MLflow run."""

import glob
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("AIRFLOW_HOME", str(ROOT / "work" / "test-airflow-home"))

from production_tier import MlflowServer, Postgres, pg_unavailable  # noqa: E402

from ftcore.util import procs as ports  # noqa: E402
from ftrec_airflow import follow, runner, settings, ui  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.integ]

START_TIMEOUT_S = 180  # API server up and the DAG parsed
RUN_TIMEOUT_S = 420  # the DAG run from trigger to success, three kills included
STEPS, STEP_S, LOG_EVERY = 180, 0.35, 10  # the training: at least 63 s, however fast the machine
PACED = [(0, 0), (1, 0), (1, 1)]  # (group, incarnation) that the `slow` fault paces
SCHEDULER_DOWN_S = 5  # kill -9 of the scheduler to the start of a new one (which boots for 10 s or so)
CLOSE_GRACE_S = 5  # SIGTERM to SIGKILL of the components at the close (the triggerer takes 10 s otherwise)
TIMEOUTS = {  # a lost task noticed in seconds: Airflow's defaults are 300 s
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "10",  # 5 missed heartbeats (every 2 s)
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "1",
    "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "2",
    "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
    "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "10",  # a scheduler silent this long is dead
    "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "2",
    "AIRFLOW__CORE__MAX_TASK_RETRY_DELAY": "1",  # the DAG's 10 s, 20 s backoff, capped
}
CONF = {
    "data_source": "synthetic",
    "synth_users": 240,
    "synth_items": 120,
    "max_steps": STEPS,
    "batch_size": 16,
    "max_len": 20,
    "replica_groups": 2,
    "fault_plan": json.dumps(
        {
            "faults": [
                # every group paced alike (group 1 after its restart too): one slower group is
                # held out by fail-slow, and its ledger would miss those steps
                *({"kind": "slow", "group": g, "at_step": 1, "delay_s": STEP_S, "incarnation": i} for g, i in PACED),
                {"kind": "kill", "group": 1, "at_step": 4},  # the launcher restarts it; the tab shows it
            ]
        }
    ),
    "train_overrides": ["model.dim=16", "eval.batch_size=256", f"train.log_every={LOG_EVERY}", "mlflow.plots=false"],
    "champion_approval": True,  # approve_champion waits for the test's Approve (_approve)
}
FOLLOWING = "following the training job already running"  # follow.Follower.wait's first words
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
GROUP_STARTED = "[launch] group_started "


def _call(base: str, path: str, token: str | None = None, body: dict | None = None, method: str | None = None):
    req = urllib.request.Request(
        base + path,
        method=method or ("POST" if body is not None else "GET"),
        data=json.dumps(body).encode() if body is not None else None,
    )
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read().decode() or "null")


def _wait(what: str, fn, timeout: float, procs: dict, every: float = 1.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        for name, p in procs.items():
            assert p.poll() is None, f"airflow {name} exited with {p.returncode} while waiting for {what}"
        try:
            value = fn()
            if value:
                return value
        except (OSError, urllib.error.HTTPError, ValueError, KeyError) as e:
            last = e
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last})")


class Tier:
    """The running tier: Airflow's components (`procs`, by name), its servers, and what the test
    must still end at the close: retired components (a killed scheduler's group) and strays
    (processes a kill orphaned, in groups of their own)."""

    def __init__(self, tmp: Path, api_port: int):
        self.tmp, self.home = tmp, tmp / "airflow"
        self.base = f"http://127.0.0.1:{api_port}"
        self.api_port = api_port
        self.procs: dict[str, subprocess.Popen] = {}
        self.retired: list[subprocess.Popen] = []
        self.strays: list = []  # psutil.Process
        self.logs: list = []
        self.env: dict[str, str] = {}
        self.token = ""
        self.finished: Run | None = None  # the kills' run, once it passed (the browser test looks at it)
        self.airflow = str(Path(sys.executable).parent / "airflow")

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.tmp / f"{name}-{len(self.logs)}.log", "w")
        self.logs.append(log)
        self.procs[name] = subprocess.Popen(
            [self.airflow, *argv], env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )  # its own group: stopped whole at the close
        return self.procs[name]

    def start_scheduler(self) -> subprocess.Popen:
        return self.start("scheduler", ["scheduler", *dict(ui.COMPONENTS)["scheduler"]])  # no log server

    def close(self) -> None:
        import psutil

        groups = [*self.procs.values(), *self.retired]
        for p in groups:  # SIGTERM every group first, so they shut down side by side
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + CLOSE_GRACE_S
        for p in groups:  # then SIGKILL what is left after the shared grace period
            runner.stop_group(p, grace_s=max(0.0, deadline - time.monotonic()))
        for s in self.strays:
            if s.is_running():  # the same process (psutil compares its start time)
                s.kill()
        psutil.wait_procs([s for s in self.strays if s.is_running()], timeout=10)
        for f in self.logs:
            f.close()
        for name, p in self.procs.items():
            assert p.poll() is not None, f"airflow {name} (pid {p.pid}) still running"


def _environment(tier: Tier, pg: Postgres, mlflow_port: int) -> dict[str, str]:
    base = tier.base
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tier.home),
        "FTREC_WORK": str(tier.tmp / "work"),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": pg.url("airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        # the checkout's plugins/, as `make run` sets it: its ftrec_plugin.py defers to the
        # installed package's `airflow.plugins` entry point (one registration, no import error)
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "2",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",  # ftrec_retrain's cron must not fire here
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{base}/execution/",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(tier.api_port),
        "AIRFLOW__API__BASE_URL": base,
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),  # shared by every component
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "300",
        # the DAG's MLflow: the connection the tasks look up (settings.mlflow_connection)
        "AIRFLOW_CONN_FTREC_MLFLOW": json.dumps({"conn_type": "http", "host": "127.0.0.1", "port": mlflow_port}),
        **TIMEOUTS,
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


@pytest.fixture(scope="module")
def production_tier(tmp_path_factory):
    """One tier for the module: the kills' run finishes on it, then the browser looks at that run."""
    reason = pg_unavailable()
    if reason:
        pytest.skip(reason)
    tmp_path = tmp_path_factory.mktemp("tier")
    (tmp_path / "airflow").mkdir()
    tier = Tier(tmp_path, ports.free_port())
    pg = Postgres(ports.free_port(), ["airflow", "mlflow"])
    mlflow = None
    try:
        mlflow_port = ports.free_port()
        mlflow = MlflowServer(mlflow_port, pg.url("mlflow"), tmp_path / "mlflow-artifacts", tmp_path / "mlflow.log")
        tier.env = _environment(tier, pg, mlflow_port)
        migrate = [tier.airflow, "db", "migrate"]
        subprocess.run(migrate, env=tier.env, check=True, capture_output=True, timeout=300)
        tier.start("api-server", ["api-server", "--port", str(tier.api_port), "--host", "127.0.0.1"])
        tier.start("dag-processor", ["dag-processor"])
        tier.start_scheduler()
        tier.start("triggerer", ["triggerer", *dict(ui.COMPONENTS)["triggerer"]])
        yield tier, mlflow
    finally:
        try:
            tier.close()
        finally:
            _end_job(tmp_path / "work")
            if mlflow is not None:
                mlflow.close()
            pg.close()


def _end_job(work: Path) -> None:
    """A training job still holding a run folder under `work` (a failed test): its session ends."""
    for lease_dir in glob.glob(str(work / "runs" / "*" / "*" / "train" / "lease")):
        holder = follow.live_job(Path(lease_dir).parent)
        if holder is not None and holder.session == holder.pid:
            try:
                os.killpg(holder.session, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wildcard_listeners(procs: dict[str, subprocess.Popen]) -> list[tuple[str, str, int]]:
    """(component, address, port) of every socket the components' processes listen on at a
    wildcard address (a log server, say): every interface, where 127.0.0.1 was meant."""
    import psutil

    found = []
    for name, p in procs.items():
        try:
            tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in tree:
            try:
                conns = proc.net_connections(kind="inet")
            except psutil.Error:
                continue
            found += [
                (name, c.laddr.ip, c.laddr.port)
                for c in conns
                if c.status == psutil.CONN_LISTEN and c.laddr.ip in ("0.0.0.0", "::")
            ]
    return found


def _token(base: str, home: Path) -> str:
    passwords = json.loads((home / "simple_auth_manager_passwords.json.generated").read_text())
    return _call(base, "/auth/token", body={"username": "admin", "password": passwords["admin"]})["access_token"]


# ---------------------------------------------------------------- the kills


class Run:
    """One DAG run of ftrec_train on the tier: its train task, its run folder, its tries' logs."""

    def __init__(self, tier: Tier, run_id: str):
        self.tier, self.run_id = tier, run_id
        self.q = urllib.request.quote(run_id)
        self.out = settings.slug("ftrec_train"), settings.slug(run_id)
        self.train = tier.tmp / "work" / "runs" / self.out[0] / self.out[1] / "train"
        self.figures: dict[str, dict] = {}

    def api(self, path: str, body: dict | None = None, method: str | None = None):
        return _call(self.tier.base, f"/api/v2/dags/ftrec_train/dagRuns/{self.q}{path}", self.tier.token, body, method)

    def ti(self) -> dict:
        return self.api("/taskInstances/train")

    def log(self, attempt: int) -> str:
        found = glob.glob(
            str(self.tier.home / "logs" / "**" / "task_id=train" / f"attempt={attempt}.log"), recursive=True
        )
        return Path(found[0]).read_text(errors="replace") if found else ""

    def committed(self) -> list[int]:
        """The steps group 0's rank 0 recorded in the job's ledger, in order, every record counted."""
        path = self.train / "ledger" / "group-000-rank-000.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line)["step"] for line in lines if line.startswith('{"step"')]

    def wait(self, what: str, fn, timeout: float = 120):
        return _wait(what, fn, timeout, self.tier.procs, every=0.5)

    def running(self, attempt: int) -> dict:
        """Try `attempt` of train, once it runs and has a task runner, with enough steps left to kill it."""
        ti = self.wait(
            f"try {attempt} to run", lambda: (t := self.ti())["try_number"] == attempt and t["pid"] and t, 300
        )
        done = len(self.committed())
        assert done < STEPS - 20, f"the job is nearly done ({done} of {STEPS} steps) before try {attempt}'s kill"
        return ti

    def followed(self, attempt: int, since: float) -> float:
        """Seconds from `since` until try `attempt` runs and follows the live job."""
        self.wait(f"try {attempt} to follow the job", lambda: self.ti()["try_number"] == attempt and self.log(attempt))
        self.wait(f"try {attempt} to say it follows the job", lambda: FOLLOWING in self.log(attempt), 60)
        return time.monotonic() - since

    def note(self, kill: str, **figures) -> None:
        self.figures[kill] = {k: round(v, 1) if isinstance(v, float) else v for k, v in figures.items()}


def _kill_task_runner(run: Run):
    """b. kill -9 of try 1's task runner, the launcher's parent: its supervisor reports the try
    failed, and try 2 follows the job. Returns the job's lease holder (the launcher)."""
    import psutil

    ti = run.running(1)
    run.wait("the job to commit steps", lambda: len(run.committed()) >= 3, 180)
    holder = follow.live_job(run.train)
    assert holder is not None, "the job holds no lease on its run folder"
    task_runner = psutil.Process(ti["pid"])
    assert psutil.Process(holder.pid).ppid() == task_runner.pid  # the launcher's parent
    step, t0 = len(run.committed()), time.monotonic()
    task_runner.kill()
    run.wait("Airflow to end try 1", lambda: (t := run.ti())["try_number"] > 1 or t["state"] != "running")
    run.note("b. task runner", at_step=step, detected_s=time.monotonic() - t0, followed_s=run.followed(2, t0))
    return holder


def _kill_supervisor(run: Run) -> None:
    """a. kill -9 of try 2's supervisor: its task runner lives on, orphaned; Airflow fails the try
    after the heartbeat timeout, and try 3 follows the job."""
    import psutil

    task_runner = psutil.Process(run.running(2)["pid"])
    supervisor = task_runner.parent()
    assert supervisor is not None and "LocalExecutor" in " ".join(supervisor.cmdline()), supervisor
    run.tier.strays.append(task_runner)
    step, t0 = len(run.committed()), time.monotonic()
    supervisor.kill()
    run.wait("Airflow to end try 2", lambda: (t := run.ti())["try_number"] > 2 or t["state"] != "running")
    run.note("a. supervisor", at_step=step, detected_s=time.monotonic() - t0, followed_s=run.followed(3, t0))


def _kill_scheduler(run: Run) -> None:
    """c. kill -9 of the scheduler, a new one SCHEDULER_DOWN_S later: it resets try 3 as orphaned
    (the LocalExecutor cannot adopt), try 3's supervisor stops its task runner, which leaves the job
    to the next try, and try 4 follows it."""
    import psutil

    tier = run.tier
    task_runner = psutil.Process(run.running(3)["pid"])
    tier.strays += [task_runner, task_runner.parent()]
    old = tier.procs.pop("scheduler")
    tier.retired.append(old)  # its group holds its LocalExecutor workers: ended at the close
    step, t0 = len(run.committed()), time.monotonic()
    os.kill(old.pid, signal.SIGKILL)
    time.sleep(SCHEDULER_DOWN_S)
    tier.start_scheduler()
    t1 = time.monotonic()
    run.wait("the new scheduler to reset try 3", lambda: run.ti()["try_number"] > 3)
    reset = time.monotonic() - t1
    run.wait("try 3 to leave the job running", lambda: "that try follows the training job" in run.log(3), 60)
    run.note("c. scheduler", at_step=step, reset_after_restart_s=reset, followed_s=run.followed(4, t0))


def _job_verdicts(run: Run, holder) -> None:
    """One launcher, started once, committed every step once: nothing redone."""
    steps = run.committed()
    assert steps == list(range(STEPS)), f"steps committed twice or missing: {len(steps)} records"
    ledger = (run.train / "ledger" / "group-000-rank-000.jsonl").read_text()
    markers = [line for line in ledger.splitlines() if not line.startswith('{"step"')]
    assert markers == ['{"resumed_to": 0, "writer": [0, 0]}'], markers  # the rank joined once, at step 0
    launches = (run.train / follow.LOG_NAME).read_text()
    assert launches.count("[launch] lease ") == 1, launches[-3000:]  # one launcher took the folder
    started = [
        (e["group"], e["incarnation"])
        for e in map(json.loads, (x.split(" ", 2)[2] for x in launches.splitlines() if x.startswith(GROUP_STARTED)))
    ]
    assert sorted(started) == [(0, 0), (1, 0), (1, 1)], started  # each group once, and group 1 after its planned kill
    assert f'"pid": {holder.pid},' in launches
    assert "ledger check passed" in run.log(4)
    # each try's log says what ended the one before (ftrec_airflow.tries)
    assert "killed by a signal it cannot catch (SIGKILL" in run.log(2)
    assert "the previous try (task process" in run.log(3)
    # try 4 may start before try 3's supervisor learns of the reset (its next heartbeat): then it
    # finds try 3 still alive, which then leaves the job to it
    said = ("ended: JobLeftRunning: Airflow stopped this try", "is still running: its process lives")
    assert any(s in run.log(4) for s in said), run.log(4)[-3000:]
    assert "leaves the training job running" in run.log(3)


def _mlflow_verdicts(run: Run, mlflow: MlflowServer, mlflow_run: str) -> None:
    """One MLflow run with one train/loss point per logged step, and one registered version."""
    exp = _call(mlflow.url, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=ftrec")["experiment"]
    runs = _call(mlflow.url, "/api/2.0/mlflow/runs/search", body={"experiment_ids": [exp["experiment_id"]]})
    assert [r["info"]["run_id"] for r in runs["runs"]] == [mlflow_run]
    q = urllib.request.quote
    history = _call(mlflow.url, f"/api/2.0/mlflow/metrics/get-history?run_id={mlflow_run}&metric_key={q('train/loss')}")
    points = [m["step"] for m in history["metrics"]]
    assert len(points) == len(set(points)) >= STEPS // LOG_EVERY, sorted(points)
    name = q("name='ftrec'")
    versions = _call(mlflow.url, f"/api/2.0/mlflow/model-versions/search?filter={name}")
    assert [(v["version"], v["run_id"]) for v in versions["model_versions"]] == [("1", mlflow_run)]
    run.note("verdicts", steps=len(run.committed()), loss_points=len(points), versions=1)


def _ready(tier: Tier) -> None:
    """The API server answers, a login works, ftrec_train is parsed (paused) and unpaused, and the
    ftrec plugin is registered once, through its entry point."""
    base, procs = tier.base, tier.procs
    _wait("the API server", lambda: _call(base, "/api/v2/monitor/health"), START_TIMEOUT_S, procs)
    tier.token = token = _wait("a login token", lambda: _token(base, tier.home), 60, procs)
    dag = _wait(
        "ftrec_train to be parsed", lambda: _call(base, "/api/v2/dags/ftrec_train", token), START_TIMEOUT_S, procs
    )
    assert dag["is_paused"] is True
    unpaused = _call(base, "/api/v2/dags/ftrec_train", token, body={"is_paused": False}, method="PATCH")
    assert unpaused["is_paused"] is False
    plugins = _call(base, "/api/v2/plugins", token)["plugins"]
    (ftrec,) = (p for p in plugins if p["name"] == "ftrec")  # once, through the entry point
    assert ftrec["source"].startswith("ftrec==") and "ftrec_airflow.plugin:FtrecPlugin" in ftrec["source"]
    assert _call(base, "/api/v2/plugins/importErrors", token)["import_errors"] == []
    assert {v["destination"] for v in ftrec["external_views"]} == {"dag_run", "nav"}


def _finished(run: Run) -> None:
    """The run ends `success`, every task of the DAG ran, nothing listens beyond 127.0.0.1."""
    tier = run.tier

    def state():
        s = run.api("")["state"]
        return s if s in ("success", "failed") else None

    try:
        final = _wait("the DAG run to finish", state, RUN_TIMEOUT_S, tier.procs)
    finally:
        states = {t["task_id"]: t["state"] for t in run.api("/taskInstances")["task_instances"]}
    assert final == "success", f"task states: {states}; logs in {tier.tmp}"
    dag_tasks = {t["task_id"] for t in _call(tier.base, "/api/v2/dags/ftrec_train/tasks", tier.token)["tasks"]}
    assert set(states.values()) == {"success"} and set(states) == dag_tasks  # every task ran (shards fanned out)
    assert _wildcard_listeners(tier.procs) == [], "an Airflow component listens beyond 127.0.0.1"
    assert {"build_shards.prepare", "build_shards.seal", "train"} <= dag_tasks


def _approve(run: Run) -> None:
    """champion_approval is on: register_model keeps version 1 challenger only, approve_champion
    waits in Airflow's human-in-the-loop state, and the test answers Approve through the REST API
    as the UI's form does; promote_champion then makes version 1 champion."""
    hitl = "/taskInstances/approve_champion/-1/hitlDetails"
    asked = run.wait("approve_champion to ask", lambda: run.api(hitl), RUN_TIMEOUT_S)
    # a person answers once the question shows and its try has left the worker: an answer within
    # the second before the scheduler hears that try end is lost to a race in Airflow 3.3.2 (the
    # try is marked for retry, and the retry asks again; docs/airflow.md)
    run.wait(
        "approve_champion to wait for input",
        lambda: run.api("/taskInstances/approve_champion")["state"] == "awaiting_input",
    )
    parked = "TaskInstance Finished: dag_id=ftrec_train, task_id=approve_champion"
    run.wait(
        "the scheduler to see its try leave",
        lambda: any(parked in Path(f).read_text() for f in glob.glob(str(run.tier.tmp / "scheduler-*.log"))),
    )
    assert asked["options"] == ["Approve", "Reject"] and asked["defaults"] == ["Reject"], asked
    assert asked["subject"] == "Make version 1 of ftrec champion?" and not asked["response_received"]
    reg = run.api("/taskInstances/register_model/xcomEntries/return_value")["value"]
    reg = json.loads(reg) if isinstance(reg, str) else reg
    assert (reg["promoted"], reg["aliases"], reg["approval"]["asked"]) == (False, ["challenger"], True), reg
    assert run.api(hitl, body={"chosen_options": ["Approve"]}, method="PATCH")["chosen_options"] == ["Approve"]


def _links(run: Run, mlflow: MlflowServer) -> str:
    """The train task's links (its MLflow run on the MLflow server, the lighthouse page), the
    plugin's page behind Airflow's login, the registered version; returns the MLflow run id."""
    base, token, q = run.tier.base, run.tier.token, run.q
    links = run.api("/taskInstances/train/links")["extra_links"]
    xcom = run.api("/taskInstances/train/xcomEntries/return_value")
    mlflow_run = (
        json.loads(xcom["value"])["mlflow_run_id"] if isinstance(xcom["value"], str) else xcom["value"]["mlflow_run_id"]
    )
    assert links["MLflow run"].startswith(mlflow.url) and links["MLflow run"].endswith(f"/runs/{mlflow_run}")
    assert links["Lighthouse"].startswith(f"{base}/ftrec/lighthouse/?dag_id=ftrec_train")
    with pytest.raises(urllib.error.HTTPError) as anonymous:  # Airflow's login guards the plugin's page too
        _call(base, f"/ftrec/lighthouse/status?dag_id=ftrec_train&run_id={q}")
    assert anonymous.value.code in (401, 403)
    page = _call(base, f"/ftrec/lighthouse/status?dag_id=ftrec_train&run_id={q}", token)
    assert page["source"] in (f"run ftrec_train / {run.run_id}", "none")
    reg = run.api("/taskInstances/register_model/xcomEntries/return_value")["value"]
    reg = json.loads(reg) if isinstance(reg, str) else reg
    assert reg["version"] == 1 and reg["run_id"] == mlflow_run
    promoted = run.api("/taskInstances/promote_champion/xcomEntries/return_value")["value"]
    promoted = json.loads(promoted) if isinstance(promoted, str) else promoted
    assert (promoted["champion"], promoted["promoted"], promoted["aliases"]) == (1, True, ["challenger", "champion"])
    assert promoted["approved_by"] not in ("", "unknown"), promoted  # the API's user, as MLflow's tag says
    return mlflow_run


def test_ftrec_train_on_the_production_tier_survives_three_kills(production_tier):
    tier, mlflow = production_tier
    _ready(tier)
    body = {"logical_date": None, "conf": CONF}
    run = Run(tier, _call(tier.base, "/api/v2/dags/ftrec_train/dagRuns", tier.token, body=body)["dag_run_id"])
    try:  # the MLflow server, started beside Airflow's migration, is needed once train starts
        _wait("the MLflow server", mlflow.up, 120, tier.procs, every=0.5)
        holder = _kill_task_runner(run)
        _kill_supervisor(run)
        _kill_scheduler(run)
        _approve(run)
        _finished(run)
        _job_verdicts(run, holder)
        _mlflow_verdicts(run, mlflow, _links(run, mlflow))
        tier.finished = run
    finally:
        (tier.tmp / "figures.json").write_text(json.dumps(run.figures, indent=1))
        print(f"\nproduction tier, {tier.tmp}: {json.dumps(run.figures)}")


# ---------------------------------------------------------------- the run in a real browser


def _fits(page, view: str) -> None:
    """The tab's iframe holds its content at its width (the plugin's responsive layout): the
    page never needs a sideways scroll that cuts columns off."""
    frame = page.frame_locator("iframe").first
    frame.locator("text=finished").first.wait_for(timeout=60_000)
    width = page.locator("iframe").first.bounding_box()["width"]
    over = frame.locator("html").evaluate("e => e.scrollWidth - e.clientWidth")
    assert over <= 1, f"{view}: the tab is {over}px wider than its {width:.0f}px frame"


def test_the_run_in_a_real_browser(production_tier):
    """The kills' finished run, in headless Chromium driven by Playwright. Logged in: the DAG run's
    "Lighthouse" tab (the plugin's external view, an iframe inside Airflow's React UI) shows the
    finished job, both groups, group 1's restart, the chart with the fault and the failure marked,
    and fits its frame in the grid and in the graph view; a task's Logs tab shows its log; the
    MLflow run the train task links to renders in the MLflow UI; an anonymous browser is refused.
    Screenshots of the tab are kept beside the logs. Skips with the reason when Chromium or
    Playwright is not installed (`.ci/run` installs Debian's chromium; Playwright uses it, it
    downloads no browser of its own) or when the kills' run did not pass."""
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    tier, mlflow = production_tier
    run = tier.finished
    if run is None:
        pytest.skip("the production tier's run did not pass (see its test): nothing finished to look at")
    base, token, q, tmp = tier.base, tier.token, run.q, tier.tmp
    links = run.api("/taskInstances/train/links")["extra_links"]
    assert links["MLflow run"].startswith(mlflow.url)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], timeout=60_000)
        try:
            # anonymous: Airflow's login guards the plugin's page
            anon = browser.new_page()
            resp = anon.goto(f"{base}/ftrec/lighthouse/?dag_id=ftrec_train&run_id={q}")
            assert resp.status in (401, 403) and "committed steps" not in anon.content()

            ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
            ctx.add_cookies([{"name": "_token", "value": token, "url": base}])
            page = ctx.new_page()
            page.goto(f"{base}/dags/ftrec_train/runs/{q}/plugin/ftrec-lighthouse-run", wait_until="networkidle")
            tab = page.frame_locator("iframe").first
            tab.locator("text=finished").first.wait_for(timeout=60_000)
            assert tab.locator("tr.group-row").count() == 2
            assert tab.locator("svg.ftrec-timeline polyline.group").count() == 2
            marks = {
                tab.locator("svg.ftrec-timeline line.mark").nth(i).get_attribute("data-kind")
                for i in range(tab.locator("svg.ftrec-timeline line.mark").count())
            }
            assert {"fault", "group_failed"} <= marks, marks
            restarts = tab.locator("tr.group-row").nth(1).locator("td").nth(2).inner_text()
            assert restarts == "1", restarts
            assert "does not answer" not in tab.locator("body").inner_text()
            assert "its lighthouse ended with the job" in tab.locator("body").inner_text()  # no dead address
            assert "seconds since the launch" in tab.locator("body").inner_text()  # the chart's axis title
            _fits(page, "grid view")
            page.screenshot(path=str(tmp / "lighthouse-tab.png"), full_page=True)
            page.locator("body").press("g")  # Airflow's shortcut: the graph view beside the tab
            page.wait_for_timeout(1500)
            _fits(page, "graph view")
            page.screenshot(path=str(tmp / "lighthouse-tab-graph.png"), full_page=True)

            # Browse -> "ftcore lighthouse" with no standing lighthouse: said plainly, not as an error
            browse = ctx.new_page()
            browse.goto(f"{base}/plugin/ftrec-lighthouse", wait_until="networkidle")
            nav = browse.frame_locator("iframe").first
            nav.locator("text=No standing lighthouse is configured").first.wait_for(timeout=60_000)
            assert nav.locator(".bad").count() == 0

            # a task's Logs tab shows its log, not "Log file not found on worker"
            log_page = ctx.new_page()
            log_page.goto(f"{base}/dags/ftrec_train/runs/{q}/tasks/register_model", wait_until="networkidle")
            log_page.locator("text=gate verdict").first.wait_for(timeout=60_000)
            assert "Log file not found" not in log_page.locator("body").inner_text()
            if os.environ.get("FTREC_KEEP_SCREENSHOTS"):
                shutil.copy(tmp / "lighthouse-tab.png", "/tmp/lighthouse-tab.png")

            # the MLflow run the train task links to, in the MLflow UI (a React app: rendered by the browser)
            mlflow_page = ctx.new_page()
            mlflow_page.goto(links["MLflow run"], wait_until="domcontentloaded")  # its UI polls: never idle
            mlflow_page.locator(f"text=ftrec_train {run.run_id}").first.wait_for(timeout=60_000)
            mlflow_page.screenshot(path=str(tmp / "mlflow-run.png"))
        finally:
            browser.close()
    assert (tmp / "lighthouse-tab.png").stat().st_size > 10_000
