"""Unit tests of the Airflow glue (ftrec_airflow) with real processes, a real
MLflow store, a real ftcore lighthouse and the plugin's real FastAPI app; no Airflow
scheduler (test_airflow_dag_run.py and test_airflow_integration.py run the DAGs)."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import LAUNCH

ROOT = Path(__file__).resolve().parent.parent
# Importing airflow creates $AIRFLOW_HOME; keep it inside the (gitignored) work folder.
os.environ.setdefault("AIRFLOW_HOME", str(ROOT / "work" / "test-airflow-home"))

from ftrec_airflow import chaos, lighthouse_status, mlflow_registry, pipeline_ops, run_params, runner, settings  # noqa: E402


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


# ---------------------------------------------------------------- runner


class _Lines:
    def __init__(self):
        self.lines = []

    def info(self, fmt, *args):
        self.lines.append(fmt % args)

    warning = exception = info


def test_runner_streams_output_and_returns_tail():
    log = _Lines()
    tail = runner.run(
        [
            sys.executable,
            "-c",
            "import sys\nfor i in range(3): print('line', i, flush=True)\nprint('err', file=sys.stderr)",
        ],
        logger=log,
    )
    assert tail == ["line 0", "line 1", "line 2", "err"]
    assert "line 1" in log.lines and "err" in log.lines


def test_runner_failure_quotes_the_last_lines():
    with pytest.raises(runner.CommandFailed) as e:
        runner.run(
            [sys.executable, "-c", "print('error: settings x.y is wrong'); raise SystemExit(2)"], logger=_Lines()
        )
    assert e.value.returncode == 2
    assert "exit code 2" in str(e.value) and "error: settings x.y is wrong" in str(e.value)


GRANDCHILD = """
import subprocess, sys, time
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("grandchild", p.pid, flush=True)
time.sleep(60)
"""


def _run_bg(cmd: runner.Command, *args):
    box = {}

    def target():
        try:
            cmd.run(*args)
        except BaseException as e:  # handed to the test
            box["exc"] = e

    t = threading.Thread(target=target)
    t.start()
    return t, box


def _pid_from(log: _Lines, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.lines:
            if line.startswith("grandchild "):
                return int(line.split()[1])
        time.sleep(0.05)
    raise AssertionError(f"no grandchild pid in {log.lines}")


def test_runner_timeout_ends_the_whole_process_tree():
    log = _Lines()
    cmd = runner.Command([sys.executable, "-c", GRANDCHILD], logger=log)
    t, box = _run_bg(cmd, 3)
    grandchild = _pid_from(log)
    t.join(30)
    assert not t.is_alive() and isinstance(box.get("exc"), TimeoutError)
    assert _wait_dead(grandchild), "the grandchild outlived the command's timeout"
    assert not _alive(cmd.proc.pid)


def test_runner_stop_from_on_kill_ends_the_whole_process_tree():
    """What an operator's on_kill does: stop() from another frame ends leader and grandchild."""
    log = _Lines()
    cmd = runner.Command([sys.executable, "-c", GRANDCHILD], logger=log)
    t, box = _run_bg(cmd)
    grandchild = _pid_from(log)
    cmd.stop()
    t.join(30)
    assert isinstance(box.get("exc"), runner.CommandFailed)
    assert _wait_dead(grandchild)
    assert cmd.proc.returncode == -signal.SIGTERM


def test_runner_sigterm_to_the_task_process_ends_the_tree(tmp_path):
    """A real task process (here a python process running Command.run in its main thread)
    gets SIGTERM, as Airflow sends it on a kill from the UI: the command's group dies."""
    script = tmp_path / "task.py"
    script.write_text(
        "import sys\n"
        "from ftrec_airflow import runner\n"
        "class L:\n"
        "    def info(self, f, *a): print(f % a, flush=True)\n"
        "    warning = exception = info\n"
        f"runner.run([sys.executable, '-c', {GRANDCHILD!r}], logger=L())\n"
    )
    task = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = ""
        deadline = time.monotonic() + 30
        while not line.startswith("grandchild") and time.monotonic() < deadline:
            line = task.stdout.readline()
        grandchild = int(line.split()[1])
        task.send_signal(signal.SIGTERM)
        task.wait(timeout=30)
        assert _wait_dead(grandchild)
    finally:
        runner.stop_group(task, grace_s=1)


# ---------------------------------------------------------------- steps


def test_ingest_errors_name_the_file_and_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("FTREC_DATA_ROOTS", str(tmp_path))
    with pytest.raises(pipeline_ops.UserError, match="does not exist"):
        pipeline_ops.ingest(str(tmp_path / "nope.txt"), "sasrec", tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(pipeline_ops.UserError, match="empty"):
        pipeline_ops.ingest(str(empty), "sasrec", tmp_path)
    iclrec = tmp_path / "beauty_like.txt"
    iclrec.write_text("1 5 6 7\n2 8 9\n")
    with pytest.raises(pipeline_ops.UserError, match=r"line 1: format sasrec expects 2 fields.*data_format"):
        pipeline_ops.ingest(str(iclrec), "sasrec", tmp_path)
    with pytest.raises(pipeline_ops.UserError, match="data_format='csv'"):
        pipeline_ops.ingest(str(iclrec), "csv", tmp_path)
    assert pipeline_ops.ingest(str(iclrec), "iclrec", tmp_path)["format"] == "iclrec"


def test_synthetic_ingest_and_build_shards_are_idempotent(tmp_path):
    data = pipeline_ops.ingest("synthetic", "sasrec", tmp_path, synth_users=120, synth_items=60, seed=3)
    first_mtime = os.stat(data["path"]).st_mtime_ns
    again = pipeline_ops.ingest("synthetic", "sasrec", tmp_path, synth_users=120, synth_items=60, seed=3)
    assert again == data and os.stat(data["path"]).st_mtime_ns == first_mtime
    spec = pipeline_ops.ShardSpec(
        input=data["path"], fmt="sasrec", out=str(tmp_path / "shards"), world_size=2, batch_size=8, max_len=20
    )
    built = pipeline_ops.build_shards(spec)
    assert built["reused"] is False and built["steps"] > 0
    files = sorted(p.name for p in (tmp_path / "shards" / "shards").iterdir())
    assert files == ["rank-00000.parquet", "rank-00001.parquet"]
    retried = pipeline_ops.build_shards(spec)  # a retried task: same set, nothing rebuilt
    assert retried["reused"] is True and retried["fingerprint"] == built["fingerprint"]
    assert pipeline_ops.check_shards(built["path"])["steps"] == built["steps"]
    # other settings in the same folder (e.g. a cleared run with another world size) replace it
    rebuilt = pipeline_ops.build_shards(pipeline_ops.ShardSpec(**{**spec.__dict__, "world_size": 1}))
    assert rebuilt["reused"] is False and rebuilt["config"]["world_size"] == 1


def test_verify_reports_a_corrupt_shard_set(tmp_path):
    data = pipeline_ops.ingest("synthetic", "sasrec", tmp_path, synth_users=100, synth_items=50)
    built = pipeline_ops.build_shards(
        pipeline_ops.ShardSpec(input=data["path"], fmt="sasrec", out=str(tmp_path / "s"), world_size=1, batch_size=8)
    )
    shard = tmp_path / "s" / "shards" / "rank-00000.parquet"
    shard.write_bytes(shard.read_bytes()[:-100] + b"\0" * 100)
    with pytest.raises(pipeline_ops.UserError):
        pipeline_ops.check_shards(built["path"])


def test_train_command_is_the_launcher(tmp_path):
    spec = pipeline_ops.TrainSpec(
        shards="/s",
        out=str(tmp_path / "t"),
        replica_groups=2,
        ranks_per_group=1,
        fault_plan='{"faults": [{"kind": "kill", "group": 1, "at_step": 3}]}',
        max_steps=7,
        overrides=["model.dim=16"],
    )
    cmd = pipeline_ops.train_command(spec, "RUN", "sqlite:///x.db")
    assert cmd[1:4] == LAUNCH
    assert cmd[cmd.index("--replica-groups") + 1] == "2"
    plan = cmd[cmd.index("--faults") + 1]
    assert json.loads(Path(plan).read_text())["faults"][0]["kind"] == "kill"
    trainer_args = cmd[cmd.index("--") + 1 :]
    for s in ("mlflow.run_id=RUN", "mlflow.register=false", "train.max_steps=7", "model.dim=16"):
        assert s in trainer_args
    assert "train.resume=true" not in trainer_args
    (tmp_path / "t" / "replica_0" / "checkpoints" / "step-00000004").mkdir(parents=True)
    assert "train.resume=true" in pipeline_ops.train_command(spec, "RUN", "sqlite:///x.db")  # a retry resumes
    with pytest.raises(pipeline_ops.UserError, match="fault_plan"):
        pipeline_ops.train_command(pipeline_ops.TrainSpec(shards="/s", out=str(tmp_path), fault_plan="{bad"), "R", "u")
    one = pipeline_ops.train_command(pipeline_ops.TrainSpec(shards="/s", out=str(tmp_path / "u")), "RUN", "u")
    assert one[1:4] == LAUNCH and "--faults" not in one  # one group of one rank too
    assert one[one.index("--replica-groups") + 1] == one[one.index("--ranks-per-group") + 1] == "1"
    assert pipeline_ops.trainer_out(tmp_path / "u") == tmp_path / "u" / "replica_0"


def test_quality_gate_passes_and_fails_with_every_metric():
    metrics = {"test/sampled/ndcg_at_10": 0.31, "test/full/hr_at_10": 0.07}
    assert pipeline_ops.check_gate(metrics, "test/sampled/ndcg_at_10", 0.3) == 0.31
    with pytest.raises(pipeline_ops.GateFailed) as e:
        pipeline_ops.check_gate(metrics, "test/sampled/ndcg_at_10", 0.5)
    assert "test/sampled/ndcg_at_10=0.3100 < 0.5" in str(e.value) and "test/full/hr_at_10=0.0700" in str(e.value)
    with pytest.raises(pipeline_ops.UserError, match="gate_metric='test/nope'"):
        pipeline_ops.check_gate(metrics, "test/nope", 0.1)


# ---------------------------------------------------------------- local runner: --set


def test_trained_run_is_the_train_tasks_xcom_both_ways():
    """TrainedRun.of gives the XCom the local train task returned (same keys in the same
    order, JSON-able); from_dict reads it back and ignores keys it does not know."""
    spec = pipeline_ops.TrainSpec(shards="/s", out="/o", replica_groups=3, ranks_per_group=2, fault_plan="p.toml")
    result = {"checkpoint": "/o/ck", "steps": 7, "metrics": {"test/full/hr_at_10": 0.5}, "reused": True, "x": 1}
    ids = {"mlflow_run_id": "r", "experiment_id": "e", "run_url": "http://u", "tracking_uri": "sqlite:///m.db"}
    xcom = pipeline_ops.TrainedRun.of(spec, result, **ids).to_dict()
    assert list(xcom) == [
        *("mlflow_run_id", "experiment_id", "run_url", "tracking_uri", "out", "shards", "checkpoint", "steps"),
        *("metrics", "replica_groups", "ranks_per_group", "fault_plan", "reused"),
    ]
    assert xcom == {
        **ids,
        "out": "/o",
        "shards": "/s",
        "checkpoint": "/o/ck",
        "steps": 7,
        "metrics": result["metrics"],
    } | {"replica_groups": 3, "ranks_per_group": 2, "fault_plan": "p.toml", "reused": True}
    back = pipeline_ops.TrainedRun.from_dict(json.loads(json.dumps({**xcom, "added_later": 1})))
    assert back.to_dict() == xcom
    fresh = pipeline_ops.TrainedRun.of(spec, {"checkpoint": None}, **ids)  # a result.json without steps or metrics
    assert (fresh.steps, fresh.metrics, fresh.reused) == (None, {}, False)
    with pytest.raises(TypeError):
        pipeline_ops.TrainedRun.from_dict({"mlflow_run_id": "r"})  # no checkpoint, shards, tracking_uri


def test_params_table_gives_each_dag_its_own_values():
    """params() is built from PARAMS: a DAG's default replaces the table's; a mutable default
    is never shared between two DAGs; an unknown name is refused."""
    from ftrec_airflow import pipeline

    a, b = pipeline.params(), pipeline.params(max_steps=80, data_source="synthetic")
    assert list(a) == list(pipeline.PARAMS) and (b["max_steps"].value, b["data_source"].value) == (80, "synthetic")
    assert a["max_steps"].value == 0 and a["data_format"].schema == {
        "type": "string",
        "enum": list(pipeline_ops.FORMATS),
    }
    a["train_overrides"].value.append("model.dim=8")
    assert b["train_overrides"].value == [] and pipeline.params()["train_overrides"].value == []
    with pytest.raises(TypeError, match="unknown params: \\['max_step'\\]"):
        pipeline.params(max_step=1)


def test_run_params_are_one_typed_record_of_the_table():
    """RunParams: the table's defaults where a key is missing, each value of its field's type
    (a wrong one named), a list a tuple, an inline plan JSON text; the table is its fields."""
    from ftrec_airflow import pipeline
    from ftrec_airflow.run_params import RunParams

    p = RunParams.of({"max_steps": 80, "train_overrides": ["model.dim=8"], "fault_plan": {"faults": []}})
    assert (p.max_steps, p.train_overrides, p.fault_plan, p.seed) == (80, ("model.dim=8",), '{"faults": []}', 0)
    assert RunParams.of(None) == RunParams() and RunParams.of({"world_size": "", "other_dag": 1}).world_size is None
    assert [f.name for f in dataclasses.fields(RunParams)][: len(pipeline.PARAMS)] == list(pipeline.PARAMS)
    for bad, why in [
        ({"batch_size": "many"}, "param batch_size='many': must be a whole number"),
        ({"batch_size": 2.5}, "param batch_size=2.5: must be a whole number"),
        ({"champion_approval": "yes"}, "param champion_approval='yes': must be true or false"),
        ({"gate_min": True}, "param gate_min=True: must be a number"),
        ({"train_overrides": "model.dim=8"}, "param train_overrides='model.dim=8': must be a list of strings"),
        ({"seed": None}, "param seed is empty"),
    ]:
        with pytest.raises(pipeline_ops.UserError, match=re.escape(why)):
            RunParams.of(bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.seed = 1  # type: ignore[misc]


def test_local_run_refuses_a_bad_conf_in_one_line_before_airflow_starts(tmp_path, capsys):
    """`make run` with a --conf that is not a JSON object, or a bad --set: exit code 2, one
    `error:` line naming the flag, no traceback and nothing written to the work folder."""
    from ftrec_airflow import local_run

    for args, words in (
        (["--conf", "{nope"], "error: --conf is not JSON"),
        (["--conf", "[1]"], "error: --conf must be a JSON object, got '[1]'"),
        (["--set", "max_steps=10"], "error: --set 'max_steps=10': a DAG param is params.KEY=VALUE"),
        (["--set", "params.champion_approval=true"], "error: params.champion_approval: a person's approval needs"),
    ):
        assert local_run.main(["--work", str(tmp_path / "w"), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(words) and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "w").exists()


def test_local_run_set_is_the_trainers_syntax():
    """`--set params.KEY=VALUE` is a DAG param (a TOML value, bare text a string); a trainer
    setting joins train_overrides after --conf's; a bad item fails before Airflow starts."""
    from ftrec_airflow.local_run import run_conf
    from training.config import ConfigError

    conf = run_conf(
        {"train_overrides": ["model.dim=16"], "seed": 1},
        [
            "params.max_steps=10",
            "params.data_source=synthetic",
            'params.model_name="beauty"',
            "params.gate_min_margin=0.01",
            "params.fault_plan=",
            "train.epochs=3",
            "params.seed=2",
        ],
    )
    assert conf == {
        "train_overrides": ["model.dim=16", "train.epochs=3"],
        "max_steps": 10,
        "seed": 2,
        "data_source": "synthetic",
        "model_name": "beauty",
        "gate_min_margin": 0.01,
        "fault_plan": "",
    }
    for item, words in (
        ("max_steps=10", "--set params.max_steps=10"),
        ("nope.x=1", "unknown section 'nope'"),
        ("model.nope=1", "unknown key 'nope'"),
        ("train.epochs=x", "train.epochs"),
        ("params.max_steps", "section.key=value"),
        ("params.max_step=10", "no DAG param 'max_step'"),
    ):
        with pytest.raises(ConfigError, match=words) as e:
            run_conf({}, [item])
        assert repr(item) in str(e.value)
    with pytest.raises(ConfigError, match="param max_steps='ten': must be a whole number"):
        run_conf({}, ["params.max_steps=ten"])


# ---------------------------------------------------------------- tracking (real MLflow store)


def test_mlflow_run_is_found_again_and_metrics_logged_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FTREC_WORK", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = settings.tracking_uri()
    assert uri == f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    (tmp_path / "mlflow").mkdir()
    exp, run = mlflow_registry.ensure_run("exp-a", "dag/run-1/train", tracking_uri=uri)
    assert mlflow_registry.ensure_run("exp-a", "dag/run-1/train", tracking_uri=uri) == (exp, run)  # retry: same run
    assert mlflow_registry.ensure_run("exp-a", "dag/run-2/train", tracking_uri=uri)[1] != run
    c = mlflow_registry.client(uri)
    assert c.get_experiment(exp).artifact_location == (tmp_path / "mlflow" / "artifacts").as_uri()
    mlflow_registry.log_metrics(run, {"test/full/hr@10": 0.5}, prefix="eval/", tracking_uri=uri)
    mlflow_registry.log_metrics(run, {"test/full/hr@10": 0.5}, prefix="eval/", tracking_uri=uri)
    assert [m.value for m in c.get_metric_history(run, "eval/test/full/hr_at_10")] == [0.5]
    assert mlflow_registry.run_url(exp, run).endswith(f"/#/experiments/{exp}/runs/{run}")
    assert mlflow_registry.by_alias("no-such-model", mlflow_registry.CHAMPION, uri) is None


# ---------------------------------------------------------------- chaos verdict


def _timeline(gap: float = 0.1, holes: bool = False, sums=("a", "a")) -> dict:
    steps_ = []
    t = 100.0
    for s in range(1, 11):
        if holes and s == 5:
            continue
        t += gap if s != 6 else gap * 3
        steps_.append({"group": 0, "rank": 0, "step": s, "committed": True, "t": t})
    steps_.append({"group": 0, "rank": 0, "step": 6, "committed": False, "t": t})
    return {"exit_code": 0, "checksums": {str(g): c for g, c in enumerate(sums)}, "steps": steps_}


RECOVERED = {"ft/failures_detected": 1, "ft/quorum_changes": 3, "ft/heals": 1}


def test_chaos_verdict_passes_a_clean_recovery():
    v = chaos.judge(
        _timeline(), RECOVERED, chaos.DEFAULT_PLAN, replica_groups=2, max_stall_s=5, artifacts=["timeline.json"]
    )
    assert v.ok, v.problems
    assert v.facts["survivors"] == [0] and v.facts["faulted"] == [1]


@pytest.mark.parametrize(
    "timeline,metrics,artifacts,expect",
    [
        (_timeline(), {}, ["timeline.json"], "no ft/* recovery metrics"),
        (_timeline(), {**RECOVERED, "ft/heals": 0}, ["timeline.json"], "ft/heals = 0"),
        (_timeline(), RECOVERED, [], "no timeline.json artifact"),
        (_timeline(holes=True), RECOVERED, ["timeline.json"], "skipped or repeated steps"),
        (_timeline(gap=3.0), RECOVERED, ["timeline.json"], "stalled 9.0 s"),
        (_timeline(sums=("a", "b")), RECOVERED, ["timeline.json"], "final replicas differ"),
        (_timeline(sums=("a",)), RECOVERED, ["timeline.json"], "only 1 of 2 replica groups"),
    ],
)
def test_chaos_verdict_names_what_failed(timeline, metrics, artifacts, expect):
    v = chaos.judge(timeline, metrics, chaos.DEFAULT_PLAN, replica_groups=2, max_stall_s=5, artifacts=artifacts)
    assert not v.ok and any(expect in p for p in v.problems), v.problems


def test_fault_plan_files(tmp_path):
    toml = tmp_path / "plan.toml"
    toml.write_text('[[faults]]\nkind = "stop"\ngroup = 2\nat_step = 3\n')
    assert chaos.faulted_groups(chaos.load_plan(str(toml))) == {2}
    assert chaos.faulted_groups(chaos.load_plan(json.dumps(chaos.DEFAULT_PLAN))) == {1}


# ---------------------------------------------------------------- lighthouse page and links


def test_lighthouse_address_in_launcher_output():
    assert (
        lighthouse_status.address_in('[launch] launch {"lighthouse": "127.0.0.1:60627", "groups": 2}')
        == "http://127.0.0.1:60627"
    )
    assert (
        lighthouse_status.address_in(
            '[lighthouse] {"t": 1795940043.09, "kind": "listening", "address": "127.0.0.1:5000"}'
        )
        == "http://127.0.0.1:5000"
    )
    assert lighthouse_status.address_in('[lighthouse] {"t": 1795940043.0908248, "kind": "lighthouse_started"}') is None
    assert lighthouse_status.address_in("[g0r0] step 4 valid 0.47") is None


@pytest.fixture
def live_lighthouse(tmp_path, free_port):
    token = tmp_path / "token"
    token.write_text("s3cret")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ftcore.lighthouse",
            "--bind",
            f"127.0.0.1:{free_port}",
            "--min-replicas",
            "1",
            "--token-file",
            str(token),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{free_port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                lighthouse_status.fetch_status(url, token_file=token)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        yield url, token, proc
    finally:
        runner.stop_group(proc, grace_s=2)


@pytest.fixture
def page_client():
    """The plugin's app with Airflow's auth dependency answered as a logged-in reader (the
    real check runs in test_airflow_integration.py against the API server)."""
    from fastapi.testclient import TestClient

    from ftrec_airflow import lighthouse_app

    lighthouse_app.app.dependency_overrides[lighthouse_app.can_read_runs] = lambda: None
    try:
        yield TestClient(lighthouse_app.app)
    finally:
        lighthouse_app.app.dependency_overrides.clear()


def test_lighthouse_page_refuses_a_caller_airflow_has_not_authenticated():
    from fastapi.testclient import TestClient

    from ftrec_airflow.lighthouse_app import app

    r = TestClient(app).get("/lighthouse/status", params={"dag_id": "ftrec_train", "run_id": "r"})
    assert r.status_code in (401, 403)


def test_lighthouse_page_never_follows_a_planted_url_or_token_path(tmp_path, monkeypatch, page_client, free_port):
    import socket as socket_mod

    monkeypatch.setenv("FTREC_WORK", str(tmp_path / "work"))
    monkeypatch.delenv("FTREC_LIGHTHOUSE_URL", raising=False)
    monkeypatch.delenv("FTCORE_TOKEN", raising=False)
    monkeypatch.delenv("FTCORE_TOKEN_FILE", raising=False)
    secret = tmp_path / "secret.txt"
    secret.write_text("do-not-send")
    run_dir = settings.run_folder("ftrec_train", "planted")
    run_dir.mkdir(parents=True)
    seen = []
    srv = socket_mod.socket()
    srv.bind(("127.0.0.1", free_port))
    srv.listen(4)
    srv.settimeout(0.5)
    evil = {"group": "<script>alert(1)</script>", "healthy": True, "step": "<b>", "ranks": 1, "world": 1}
    (run_dir / lighthouse_status.SNAPSHOT).write_text(
        json.dumps(
            {"url": "http://203.0.113.7:80", "token_file": str(secret), "status": {"groups": [evil], "events": []}}
        )
    )
    doc = page_client.get("/lighthouse/status", params={"dag_id": "ftrec_train", "run_id": "planted"}).json()
    assert doc["live"] is False and "neither FTREC_LIGHTHOUSE_URL nor a loopback address" in doc["note"]
    page = page_client.get("/lighthouse/", params={"dag_id": "ftrec_train", "run_id": "planted"}).text
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;" in page
    assert "<b>" not in page.split("<table>")[1]
    # a loopback URL is contacted, with this server's token only (none here), never the planted path
    (run_dir / lighthouse_status.SNAPSHOT).write_text(
        json.dumps({"url": f"http://127.0.0.1:{free_port}", "token_file": str(secret), "status": None})
    )
    t = threading.Thread(
        target=lambda: page_client.get("/lighthouse/status", params={"dag_id": "ftrec_train", "run_id": "planted"})
    )
    t.start()
    try:
        conn, _ = srv.accept()
        conn.settimeout(2)
        seen.append(conn.recv(65536))
        conn.close()
    except OSError:
        pass
    t.join()
    srv.close()
    assert seen and b"do-not-send" not in seen[0] and b"Authorization" not in seen[0]


def test_lighthouse_page_live_then_from_snapshot(tmp_path, monkeypatch, live_lighthouse, page_client):
    url, token, proc = live_lighthouse
    monkeypatch.setenv("FTREC_WORK", str(tmp_path / "work"))
    monkeypatch.delenv("FTREC_LIGHTHOUSE_URL", raising=False)
    monkeypatch.delenv("FTCORE_TOKEN_FILE", raising=False)
    monkeypatch.delenv("FTCORE_TOKEN", raising=False)
    run_dir = settings.run_folder("ftrec_train", "manual__2026-01-01T00:00:00+00:00")
    with pytest.raises(OSError):
        lighthouse_status.fetch_status(url)  # no token: refused (401)
    (run_dir / "train").mkdir(parents=True)
    with lighthouse_status.Watcher(run_dir, token_file=token) as w:
        w.see(f'[launch] launch {{"lighthouse": "{url[7:]}", "groups": 2}}')
    snap = lighthouse_status.read_snapshot(run_dir)
    assert snap["url"] == url and snap["status"]["min_replicas"] == 1 and "token_file" not in snap
    client = page_client
    q = {"dag_id": "ftrec_train", "run_id": "manual__2026-01-01T00:00:00+00:00"}
    # the page holds no token of this lighthouse: the train task's snapshot, and why
    refused = client.get("/lighthouse/status", params=q).json()
    assert refused["live"] is False and "(HTTP 401)" in refused["error"] and refused["status"]["min_replicas"] == 1
    monkeypatch.setenv("FTCORE_TOKEN_FILE", str(token))  # the API server's own configuration: live
    live = client.get("/lighthouse/status", params=q).json()
    assert live["live"] is True and "events" in live["status"]
    page = client.get("/lighthouse/", params=q)
    assert page.status_code == 200 and "ftcore lighthouse" in page.text and "live" in page.text
    runner.stop_group(proc, grace_s=2)  # training over: the page falls back to the snapshot
    after = client.get("/lighthouse/status", params=q).json()
    assert after["live"] is False and after["status"]["min_replicas"] == 1 and "does not answer" in after["error"]
    assert "snapshot of" in client.get("/lighthouse/", params=q).text
    none = client.get("/lighthouse/status", params={"dag_id": "x", "run_id": "y"}).json()
    assert none["status"] is None and "no lighthouse recorded" in none["note"] and not none["error"]


def test_operator_links_and_plugin():
    from types import SimpleNamespace

    from ftrec_airflow.decorators import BuildShardsOperator, FaultTolerantTrainOperator
    from ftrec_airflow.links import LighthouseLink, MLflowRunLink

    names = {link.name for link in FaultTolerantTrainOperator.operator_extra_links}
    assert names == {"MLflow run", "Lighthouse"}
    op = SimpleNamespace(mlflow_run_url="http://127.0.0.1:5000/#/experiments/1/runs/abc")
    key = SimpleNamespace(dag_id="ftrec_train", run_id="manual__x+1")
    assert MLflowRunLink().get_link(op, ti_key=key) == op.mlflow_run_url
    link = LighthouseLink().get_link(op, ti_key=key)
    assert link.endswith("/ftrec/lighthouse/?dag_id=ftrec_train&run_id=manual__x%2B1")
    assert BuildShardsOperator.custom_operator_name == "@build_shards_task"
    from ftrec_airflow.plugin import FtrecPlugin as plugin

    assert plugin.fastapi_apps[0]["url_prefix"] == "/ftrec"
    views = {v["destination"]: v for v in plugin.external_views}
    assert views["dag_run"]["href"].startswith("/ftrec/lighthouse/?dag_id={DAG_ID}&run_id={RUN_ID}")
    assert views["nav"]["href"] == "/ftrec/lighthouse/"


def test_retrain_reads_new_data_from_the_triggering_asset_event(monkeypatch):
    from types import SimpleNamespace

    from ftrec_airflow import tasks

    p = run_params.RunParams.of({"data_source": "auto", "data_format": "iclrec"})
    event = SimpleNamespace(extra={"path": "/data/new.txt", "format": "sasrec"})
    monkeypatch.setattr(
        tasks, "get_current_context", lambda: {"triggering_asset_events": {"ftrec_interactions": [event]}}
    )
    assert tasks.new_data_source(p) == ("/data/new.txt", "sasrec")
    monkeypatch.setattr(tasks, "get_current_context", lambda: {"triggering_asset_events": {}})
    assert tasks.new_data_source(p) == ("auto", "iclrec")  # the daily run: the params


ESCAPEE = """
import subprocess, sys
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
print("escapee", p.pid, flush=True)
"""


def test_runner_ends_a_daemon_that_left_the_process_group():
    """A command that starts a process in its own session and exits at once (as a launcher
    might leave a restarted lighthouse behind): the runner still ends that process."""
    log = _Lines()
    runner.run([sys.executable, "-c", ESCAPEE], logger=log)
    pid = int(next(line for line in log.lines if line.startswith("escapee")).split()[1])
    assert _wait_dead(pid), "the escaped process outlived the command"
    assert any("left behind" in line for line in log.lines)


@pytest.mark.integ
def test_train_step_joins_a_standing_lighthouse_with_the_workers_token(tmp_path, monkeypatch, live_lighthouse):
    """FTREC_LIGHTHOUSE_URL set: the launcher starts no lighthouse and makes no token; its
    ranks reach the standing one (which refuses anyone without its token) under the run's job id."""
    from conftest import cli_shard_set

    url, token, proc = live_lighthouse
    shards = cli_shard_set(tmp_path)
    monkeypatch.setenv("FTREC_LIGHTHOUSE_URL", url)
    monkeypatch.setenv("FTCORE_TOKEN_FILE", str(token))
    monkeypatch.delenv("FTCORE_TOKEN", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_key = "ftrec_train/manual__2026-12-01T00:00:00+00:00/train"
    _, run_id = mlflow_registry.ensure_run("standing", run_key, tracking_uri=uri)
    out = tmp_path / "t"
    spec = pipeline_ops.TrainSpec(
        shards=str(shards),
        out=str(out),
        replica_groups=2,
        max_steps=4,
        run_key=run_key,
        experiment="standing",
        timeout_s=240,
        overrides=[
            "model.dim=16",
            "loss.kind=sampled_softmax",
            "loss.num_negatives=16",
            "mlflow.log_model=false",
            "mlflow.plots=false",
            "eval.batch_size=256",
        ],
    )
    cmd = pipeline_ops.train_command(spec, run_id, uri)
    assert cmd[cmd.index("--lighthouse") + 1] == url.removeprefix("http://")
    job = cmd[cmd.index("--job-id") + 1]
    assert job == settings.lighthouse_job_id(run_key) and job.startswith("ftrec_train/manual__2026-12-01")
    result = pipeline_ops.run_training(spec, run_id, uri)
    assert result["steps"] == 4 and result["mlflow_run_id"] == run_id
    assert not (out / "token").exists() and not (out / "lighthouse-events.jsonl").exists()
    st = lighthouse_status.fetch_status(url, token_file=token, job=job)
    # the job ended: the lighthouse retired it and still shows its final state
    assert st["job"] == job and job not in st["jobs"] and st["retired"]["reason"]
    assert [(g["group"], g["left"]) for g in st["groups"]] == [(0, True), (1, True)]
    assert any(e["kind"] == "quorum_formed" for e in st["events"])
    assert lighthouse_status.fetch_status(url, token_file=token)["groups"] == []  # nothing under the default job
    # the task's end checks the ledger, on a retry too: a batch planted as trained twice fails it
    assert pipeline_ops.run_training(spec, run_id, uri)["reused"] is True
    lines = (out / "ledger" / "group-000-rank-000.jsonl").read_text().splitlines()
    first = next(r for r in map(json.loads, lines) if r.get("step") == 0)
    (out / "ledger" / "group-000-rank-009.jsonl").write_text(json.dumps({**first, "step": 4}) + "\n")
    with pytest.raises(pipeline_ops.ExactlyOnceBroken, match=r"trained twice \[\("):
        pipeline_ops.run_training(spec, run_id, uri)


def test_build_step_retries_with_overwrite_only_for_another_shard_set(tmp_path):
    from dataprep.synth import write_synthetic

    src = write_synthetic(tmp_path / "ev.txt", users=300, items=100, seed=0)
    out = tmp_path / "shards"
    out.mkdir()
    (out / "keep.txt").write_text("not a shard set")
    with pytest.raises(pipeline_ops.UserError, match="holds no shard set"):
        pipeline_ops.build_shards(
            pipeline_ops.ShardSpec(input=str(src), fmt="sasrec", out=str(out), world_size=2, batch_size=8)
        )
    assert (out / "keep.txt").exists()
    (out / "keep.txt").unlink()
    first = pipeline_ops.build_shards(
        pipeline_ops.ShardSpec(input=str(src), fmt="sasrec", out=str(out), world_size=2, batch_size=8)
    )
    again = pipeline_ops.build_shards(
        pipeline_ops.ShardSpec(input=str(src), fmt="sasrec", out=str(out), world_size=4, batch_size=8)
    )
    assert first["config"]["world_size"] == 2 and again["config"]["world_size"] == 4 and not again["reused"]


@pytest.mark.parametrize("run_id", ["..", "../..", ".", "a/../../b", "..hidden", "manual__..__x"])
def test_a_run_id_never_leaves_the_runs_folder(tmp_path, monkeypatch, run_id):
    monkeypatch.setenv("FTREC_WORK", str(tmp_path / "work"))
    folder = settings.run_folder("ftrec_train", run_id).resolve()
    assert folder.parent == (tmp_path / "work" / "runs" / settings.slug("ftrec_train")).resolve()
    assert ".." not in folder.name and folder.name not in (".", "")


def test_build_step_reports_each_stage_as_it_goes(tmp_path):
    from dataprep.synth import write_synthetic

    src = write_synthetic(tmp_path / "ev.txt", users=300, items=100, seed=0)
    lines: list[str] = []
    spec = pipeline_ops.ShardSpec(
        input=str(src), fmt="sasrec", out=str(tmp_path / "shards"), world_size=2, batch_size=8
    )
    pipeline_ops.build_shards(spec, log=lines.append)
    assert [line.split()[1] for line in lines] == ["read", "300", lines[2].split()[1], "wrote"], lines
    assert "steps balanced over 2 ranks" in lines[2] and "rejected" in lines[0] and "training samples" in lines[1]
    lines.clear()
    pipeline_ops.build_shards(spec, log=lines.append)
    assert len(lines) == 1 and "reused" in lines[0]


# ---------------------------------------------------------------- the ftrec_mlflow connection


@pytest.fixture
def no_mlflow_env(monkeypatch):
    for k in ("MLFLOW_TRACKING_URI", "AIRFLOW_CONN_FTREC_MLFLOW", "FTREC_MLFLOW_UI", *settings.MLFLOW_CREDENTIALS):
        monkeypatch.delenv(k, raising=False)  # restored after the test, whatever connect() set
    return monkeypatch


def test_mlflow_connection_then_env_then_embedded_store(tmp_path, no_mlflow_env):
    mp = no_mlflow_env
    mp.setenv("FTREC_WORK", str(tmp_path))
    # No connection anywhere: the answer comes from the environment backend alone, without
    # asking a database-backed secrets backend or opening a database connection.
    import sqlalchemy.event
    import sqlalchemy.pool
    from airflow.sdk.execution_time import supervisor

    asked, connects = [], []
    real = supervisor.ensure_secrets_backend_loaded

    class Spy:
        def __init__(self, backend):
            self.backend = backend

        def get_connection(self, conn_id):
            conn = self.backend.get_connection(conn_id=conn_id)
            asked.append((type(self.backend).__name__, conn_id, conn is not None))
            return conn

    def on_connect(*args):
        connects.append(args)

    mp.setattr(supervisor, "ensure_secrets_backend_loaded", lambda: [Spy(b) for b in real()])
    sqlalchemy.event.listen(sqlalchemy.pool.Pool, "connect", on_connect)
    try:
        assert settings.mlflow_connection() == (f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}", {})
    finally:
        sqlalchemy.event.remove(sqlalchemy.pool.Pool, "connect", on_connect)
    assert asked == [("EnvironmentVariablesBackend", settings.MLFLOW_CONN_ID, False)] and connects == []
    mp.setenv("MLFLOW_TRACKING_URI", "http://env-mlflow:5000")
    mp.setenv("MLFLOW_TRACKING_TOKEN", "env-token")
    assert settings.mlflow_connection() == ("http://env-mlflow:5000", {"MLFLOW_TRACKING_TOKEN": "env-token"})
    # Airflow's own mechanism: a connection in AIRFLOW_CONN_<ID> (JSON) wins over the env
    mp.setenv(
        "AIRFLOW_CONN_FTREC_MLFLOW",
        json.dumps(
            {
                "conn_type": "http",
                "host": "mlflow.internal",
                "port": 5443,
                "schema": "https",
                "login": "alice",
                "password": "s3cret",
            }
        ),
    )
    uri, creds = mlflow_registry.connect()
    assert uri == "https://mlflow.internal:5443"
    assert creds == {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "s3cret"}
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "s3cret" and "MLFLOW_TRACKING_TOKEN" not in os.environ
    env = pipeline_ops.train_env(uri, creds)  # the training processes get them in their environment
    assert env["MLFLOW_TRACKING_USERNAME"] == "alice" and env["MLFLOW_TRACKING_URI"] == uri
    assert not any(
        "s3cret" in a
        for a in pipeline_ops.train_command(pipeline_ops.TrainSpec(shards="/s", out=str(tmp_path / "t")), "RUN", uri)
    )
    assert mlflow_registry.run_url("7", "abc") == "https://mlflow.internal:5443/#/experiments/7/runs/abc"
    mp.setenv("AIRFLOW_CONN_FTREC_MLFLOW", "http://mlflow.internal:5000")  # URI form, no auth
    assert settings.mlflow_connection() == ("http://mlflow.internal:5000", {})
    mp.setenv(
        "AIRFLOW_CONN_FTREC_MLFLOW", json.dumps({"conn_type": "http", "extra": {"tracking_uri": "sqlite:///m.db"}})
    )
    assert settings.mlflow_ui() == settings.DEFAULT_MLFLOW_UI  # a file store: the local `mlflow ui`
    mp.setenv("AIRFLOW_CONN_FTREC_MLFLOW", json.dumps({"host": "mlflow", "extra": {"ui_url": "https://ui.example/"}}))
    assert settings.mlflow_ui() == "https://ui.example"
    mp.setenv("FTREC_MLFLOW_UI", "http://127.0.0.1:5055")
    assert settings.mlflow_ui() == "http://127.0.0.1:5055"
    mp.setenv(
        "AIRFLOW_CONN_FTREC_MLFLOW",
        json.dumps(
            {"conn_type": "http", "extra": {"tracking_uri": "https://mlflow.example.com/prefix", "token": "tok"}}
        ),
    )
    assert settings.mlflow_connection() == ("https://mlflow.example.com/prefix", {"MLFLOW_TRACKING_TOKEN": "tok"})


# ---------------------------------------------------------------- where the train task runs


def test_train_task_args_from_env_or_airflow_cfg(monkeypatch):
    for k in ("QUEUE", "POOL", "PRIORITY_WEIGHT", "EXECUTOR_CONFIG"):
        monkeypatch.delenv(f"FTREC_TRAIN_{k}", raising=False)
        monkeypatch.delenv(f"AIRFLOW__FTREC__TRAIN_{k}", raising=False)
    assert settings.train_task_args() == {}  # the operator's defaults
    monkeypatch.setenv("FTREC_TRAIN_QUEUE", "gpu")
    monkeypatch.setenv("FTREC_TRAIN_PRIORITY_WEIGHT", "10")
    monkeypatch.setenv("FTREC_TRAIN_EXECUTOR_CONFIG", '{"gpus": 8}')
    monkeypatch.setenv("AIRFLOW__FTREC__TRAIN_POOL", "trainers")  # = [ftrec] train_pool in airflow.cfg
    monkeypatch.setenv("AIRFLOW__FTREC__TRAIN_QUEUE", "ignored")  # FTREC_TRAIN_QUEUE comes first
    assert settings.train_task_args() == {
        "queue": "gpu",
        "pool": "trainers",
        "priority_weight": 10,
        "executor_config": {"gpus": 8},
    }
    monkeypatch.setenv("FTREC_TRAIN_EXECUTOR_CONFIG", "{nope")
    with pytest.raises(ValueError, match="executor_config a JSON object"):
        settings.train_task_args()


# ---------------------------------------------------------------- test metrics once


def test_evaluate_logs_only_what_the_trainer_did_not_and_the_gate_finds_it(tmp_path, monkeypatch):
    """The trainer logged test/* on the run; evaluate adds nothing under those names and no
    eval/ copies, only a metric the run lacks; the gate reads the run's values."""
    from types import SimpleNamespace

    from ftrec_airflow import tasks

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("FTREC_WORK", str(tmp_path / "work"))
    monkeypatch.delenv("AIRFLOW_CONN_FTREC_MLFLOW", raising=False)
    monkeypatch.setattr(
        tasks, "get_current_context", lambda: {"ti": SimpleNamespace(dag_id="ftrec_train"), "run_id": "r1"}
    )
    _, run = mlflow_registry.ensure_run("exp", "ftrec_train/r1/train", tracking_uri=uri)
    c = mlflow_registry.client(uri)
    c.log_metric(run, "test/sampled/ndcg_at_10", 0.3125, step=10)  # as the trainer logs its final scores
    c.log_metric(run, "test/full/ndcg_at_10", 0.0625, step=10)
    # the evaluation's result file is there: pipeline_ops.judge reads it instead of evaluating again
    out = tasks.run_dir() / "eval.json"
    out.parent.mkdir(parents=True)
    split = {"fingerprint": "f" * 64, "eval_sha256": "e" * 64, "shards": "/shards"}
    split |= {"kind": "temporal", "cut": "1700000000", "horizon": "86400"}  # the window both are judged on
    metrics = {"test/sampled/ndcg@10": 0.3125, "test/full/ndcg@10": 0.0625, "test/full/mrr": 0.04}
    out.write_text(json.dumps({"metrics": metrics, "champion": None, "champion_error": None, "split": split}))
    trained = {"mlflow_run_id": run, "tracking_uri": uri, "checkpoint": "/ckpt", "shards": "/shards"}
    ev = tasks.evaluate(trained, params={"model_name": "none-yet"})
    assert ev["logged"] == ["test/full/mrr"]
    assert ev["metrics"] == {"test/sampled/ndcg_at_10": 0.3125, "test/full/ndcg_at_10": 0.0625, "test/full/mrr": 0.04}
    assert ev["champion"] == {"version": None, "metrics": None, "error": None} and ev["split"] == split
    tasks.evaluate(trained, params={"model_name": "none-yet"})  # a retry adds nothing either
    metrics = mlflow_registry.run_metrics(run, uri)
    assert sorted(metrics) == ["test/full/mrr", "test/full/ndcg_at_10", "test/sampled/ndcg_at_10"]
    assert len(c.get_metric_history(run, "test/sampled/ndcg_at_10")) == 1
    params = c.get_run(run).data.params
    assert (params["gate.split"], params["gate.split_cut"], params["gate.split_horizon"]) == (
        "temporal",
        "1700000000",
        "86400",
    )
    assert pipeline_ops.check_gate(ev["metrics"], run_params.GATE_METRIC, 0.06) == 0.0625


# ---------------------------------------------------------------- registry aliases


def _version(c, name: str) -> int:
    mv = c.create_model_version(name, source="file:///nowhere/model", run_id=None)
    return int(mv.version)


def test_champion_moves_only_to_a_winner_judged_against_the_current_champion(tmp_path):
    """tracking.promote applies pipeline_ops.verdict's decision: a loser gets `challenger` only; a
    winner judged against a champion that has moved since is kept out; a retry changes nothing."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = mlflow_registry.client(uri)
    assert mlflow_registry.by_alias("recs", mlflow_registry.CHAMPION, uri) is None  # no model yet
    c.create_registered_model("recs")
    assert mlflow_registry.by_alias("recs", mlflow_registry.CHAMPION, uri) is None  # a model, no alias
    said: list[str] = []

    def promote(v, won, judged, why="why"):
        return mlflow_registry.promote("recs", v, won=won, reason=why, judged=judged, tracking_uri=uri, log=said.append)

    v1 = _version(c, "recs")
    assert promote(v1, True, None, "first") == {
        "champion": 1,
        "promoted": True,
        "aliases": ["challenger", "champion"],
        "reason": "first",
    }
    v2 = _version(c, "recs")  # lost on the same split: challenger only
    r = promote(v2, False, 1, "lost")
    assert (r["champion"], r["promoted"], r["aliases"]) == (1, False, ["challenger"])
    assert mlflow_registry.by_alias("recs", mlflow_registry.CHAMPION, uri)["version"] == 1
    assert mlflow_registry.by_alias("recs", mlflow_registry.CHALLENGER, uri)["version"] == 2
    v3 = _version(c, "recs")  # won: champion
    assert promote(v3, True, 1)["champion"] == 3
    assert promote(v3, True, 1) == {
        "champion": 3,
        "promoted": False,
        "aliases": ["challenger", "champion"],
        "reason": "already the champion",
    }  # a retry changes nothing
    v4 = _version(c, "recs")  # won against version 1, but version 3 is champion now: not comparable
    r = promote(v4, True, 1)
    assert (r["champion"], r["promoted"], r["aliases"]) == (3, False, ["challenger"])
    assert "the champion is version 3, not version 1" in said[-1]
    v5 = _version(c, "recs")  # no champion when judged, one now: kept out too
    assert promote(v5, True, None)["champion"] == 3


def test_local_run_stopped_by_sigterm_ends_its_child(tmp_path):
    """`python -m ftrec_airflow.local_run` runs the DAG in a child of its own session, which a
    SIGTERM to the parent alone does not reach: the parent must end it before it goes."""
    cmd = [sys.executable, "-m", "ftrec_airflow.local_run", "--work", str(tmp_path), "--timeout", "120"]
    parent = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = None
    try:
        deadline = time.monotonic() + 60
        while child is None and time.monotonic() < deadline and parent.poll() is None:
            kids = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
            child = int(kids[0]) if kids else None
            time.sleep(0.05)
        assert child is not None, "local_run started no child"
        time.sleep(1.0)  # the child is importing Airflow, well before its DAG run could end
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(30) == 130
        assert _wait_dead(child), "the child outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if child is not None:
            try:
                os.killpg(child, signal.SIGKILL)  # its own session: group id == its pid
            except ProcessLookupError:
                pass


def test_a_retry_balances_by_the_cost_model_its_first_try_calibrated(tmp_path, monkeypatch):
    """A noisy calibration is not cached machine-wide (the next build times the model again, and
    its figures differ): the build's copy beside its shard set is what a retry of the same build
    uses, so the set it finds is its own and is reused, not rebuilt. Another model calibrates afresh."""
    from dataprep.cost import load_cost_model

    monkeypatch.setenv("FTREC_WORK", str(tmp_path / "work"))
    spec = pipeline_ops.ShardSpec(
        input="-", fmt="sasrec", out=str(tmp_path / "run" / "shards"), world_size=2, max_len=20,
        model_overrides=["model.dim=8", "model.num_layers=1"],
    )  # fmt: skip
    first = pipeline_ops.shard_settings(spec, log=None).cost_model
    # a calibrated model, read back (a noisy fit may give a = 0)
    assert Path(first).parent == tmp_path / "run" and load_cost_model(first).source != "default"
    written = Path(first).read_text()
    cache = settings.work_root() / "cost-models"
    assert list(cache.glob("**/cost-*.json"))  # the machine-wide calibration (or its noisy copy)
    shutil.rmtree(cache)  # as if it had been noisy: nothing cached
    again = pipeline_ops.shard_settings(spec, log=None).cost_model
    assert again == first and Path(again).read_text() == written and not cache.exists()  # not timed again
    other = pipeline_ops.ShardSpec(**{**spec.__dict__, "model_overrides": ["model.dim=16", "model.num_layers=1"]})
    assert pipeline_ops.shard_settings(other, log=None).cost_model != first and cache.exists()


def test_a_dag_sets_fault_tolerance_through_the_trainers_ft_section(tmp_path):
    """`--set ft.KEY=VALUE` (or the train_overrides param) is a trainer setting; the launcher
    the train task runs turns it into the FTCORE_* variable of every rank and of the lighthouse
    it hosts; a bad one fails at the launcher's parse, before any rank starts."""
    from ftrec_airflow.local_run import run_conf
    from training import launch

    conf = run_conf({}, ["ft.lease=5", "ft.heartbeat_timeout=1.5"])
    assert conf["train_overrides"] == ["ft.lease=5", "ft.heartbeat_timeout=1.5"]
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "manifest.json").write_text("{}")
    spec = pipeline_ops.TrainSpec(shards=str(shards), out=str(tmp_path / "t"), overrides=conf["train_overrides"])
    cmd = pipeline_ops.train_command(spec, "RUN", "sqlite:///x.db")
    env = launch.TrainerLauncher(launch.parse(cmd[cmd.index("launch") + 1 :])).job_env()
    assert env["FTCORE_LEASE"] == "5.0" and env["FTCORE_HEARTBEAT_TIMEOUT"] == "1.5"
    bad = [*cmd[cmd.index("launch") + 1 :], "--set", "ft.heartbeat_timeout=9"]  # not below collective_timeout
    with pytest.raises(launch.LaunchError, match="ft.heartbeat_timeout < ft.collective_timeout"):
        launch.parse(bad)


def test_a_rank_refuses_ft_settings_its_environment_does_not_carry(tmp_path, capsys):
    """A rank started without the launcher (torchrun) and without the variables would silently
    run on other settings: it stops and says which and how to give them."""
    from training.__main__ import main

    assert main(["train", "--shards", str(tmp_path), "--set", "ft.lease=7"]) == 2
    err = capsys.readouterr().err
    assert "ft.lease=7.0 but this rank runs with" in err and "FTCORE_LEASE" in err and "training launch" in err
