"""A real Airflow: scheduler, DAG processor and API server (SQLite metadata, LocalExecutor,
127.0.0.1 on a free port). The test logs in through the REST API, triggers ftrec_train with
small params, waits (bounded) for success, checks the task links and the plugin's
lighthouse page on the same server, then stops every process it started by its process
group."""

import json
import os
import secrets
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

from ftrec_airflow import runner, ui  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.integ]

START_TIMEOUT_S = 180  # API server up and the DAG parsed
RUN_TIMEOUT_S = 300  # the DAG run from trigger to success
CONF = {
    "data_source": "synthetic",
    "synth_users": 240,
    "synth_items": 120,
    "max_steps": 8,
    "batch_size": 16,
    "max_len": 20,
    "replica_groups": 1,
    "train_overrides": ["model.dim=16", "eval.batch_size=256"],
}


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


def _wait(what: str, fn, timeout: float, procs: dict):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        for name, p in procs.items():
            assert p.poll() is None, f"airflow {name} exited with {p.returncode} while waiting for {what}"
        try:
            value = fn()
            if value:
                return value
        except (OSError, urllib.error.HTTPError, ValueError) as e:
            last = e
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last})")


@pytest.fixture
def airflow_server(tmp_path, free_port):
    home = tmp_path / "airflow"
    home.mkdir()
    base = f"http://127.0.0.1:{free_port}"
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "FTREC_WORK": str(tmp_path / "work"),
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
        "AIRFLOW__API__PORT": str(free_port),
        "AIRFLOW__API__BASE_URL": base,
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),  # shared by every component
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "300",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    airflow = str(Path(sys.executable).parent / "airflow")
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
    procs: dict[str, subprocess.Popen] = {}
    logs = {}
    try:
        for name, argv in (
            ("api-server", ["api-server", "--port", str(free_port), "--host", "127.0.0.1"]),
            ("dag-processor", ["dag-processor"]),
            ("scheduler", ["scheduler", *dict(ui.COMPONENTS)["scheduler"]]),  # as `make run`'s UI: no log server
        ):
            logs[name] = open(tmp_path / f"{name}.log", "w")
            procs[name] = subprocess.Popen(
                [airflow, *argv], env=env, stdout=logs[name], stderr=subprocess.STDOUT, start_new_session=True
            )  # its own group: stopped whole below
        yield base, home, procs, tmp_path
    finally:
        for p in procs.values():  # SIGTERM every group first, so they shut down side by side
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        for p in procs.values():  # then SIGKILL what is left after the shared grace period
            runner.stop_group(p, grace_s=max(0.0, deadline - time.monotonic()))
        for f in logs.values():
            f.close()
        for name, p in procs.items():
            assert p.poll() is not None, f"airflow {name} (pid {p.pid}) still running"


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


def test_trigger_ftrec_train_through_the_rest_api(airflow_server):
    base, home, procs, tmp = airflow_server
    _wait("the API server", lambda: _call(base, "/api/v2/monitor/health"), START_TIMEOUT_S, procs)
    token = _wait("a login token", lambda: _token(base, home), 60, procs)
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

    run = _call(base, "/api/v2/dags/ftrec_train/dagRuns", token, body={"logical_date": None, "conf": CONF})
    run_id = run["dag_run_id"]

    def finished():
        state = _call(base, f"/api/v2/dags/ftrec_train/dagRuns/{urllib.request.quote(run_id)}", token)["state"]
        return state if state in ("success", "failed") else None

    try:
        state = _wait("the DAG run to finish", finished, RUN_TIMEOUT_S, procs)
    finally:
        tis = _call(base, f"/api/v2/dags/ftrec_train/dagRuns/{urllib.request.quote(run_id)}/taskInstances", token)
        states = {t["task_id"]: t["state"] for t in tis["task_instances"]}
    assert state == "success", f"task states: {states}; logs in {tmp}"
    dag_tasks = {t["task_id"] for t in _call(base, "/api/v2/dags/ftrec_train/tasks", token)["tasks"]}
    assert set(states.values()) == {"success"} and set(states) == dag_tasks  # every task ran (shards fanned out)
    assert _wildcard_listeners(procs) == [], "an Airflow component listens beyond 127.0.0.1"
    assert {"build_shards.prepare", "build_shards.seal", "train"} <= dag_tasks

    q = urllib.request.quote(run_id)
    links = _call(base, f"/api/v2/dags/ftrec_train/dagRuns/{q}/taskInstances/train/links", token)["extra_links"]
    xcom = _call(base, f"/api/v2/dags/ftrec_train/dagRuns/{q}/taskInstances/train/xcomEntries/return_value", token)
    mlflow_run = (
        json.loads(xcom["value"])["mlflow_run_id"] if isinstance(xcom["value"], str) else xcom["value"]["mlflow_run_id"]
    )
    assert links["MLflow run"].endswith(f"/runs/{mlflow_run}")
    assert links["Lighthouse"].startswith(f"{base}/ftrec/lighthouse/?dag_id=ftrec_train")
    with pytest.raises(urllib.error.HTTPError) as anonymous:  # Airflow's login guards the plugin's page too
        _call(base, f"/ftrec/lighthouse/status?dag_id=ftrec_train&run_id={q}")
    assert anonymous.value.code in (401, 403)
    page = _call(base, f"/ftrec/lighthouse/status?dag_id=ftrec_train&run_id={q}", token)
    assert page["source"] in (f"run ftrec_train / {run_id}", "none")
    reg = _call(
        base, f"/api/v2/dags/ftrec_train/dagRuns/{q}/taskInstances/register_model/xcomEntries/return_value", token
    )["value"]
    reg = json.loads(reg) if isinstance(reg, str) else reg
    assert reg["version"] == 1 and reg["run_id"] == mlflow_run
