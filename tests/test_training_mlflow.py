"""MLflow tracking: the embedded SQLite store, a real `mlflow server` on loopback, and an
unreachable server that must not stop training (what it could not send is flushed later)."""

import importlib.metadata
import json
import os
import subprocess
import sys
import time
import urllib.request

import mlflow
import pytest
from conftest import ROOT, synthetic_shards
from mlflow import MlflowClient

from training.config import EvalConfig, MlflowConfig, load_config
from training.data import ShardSet
from training.evaluate import EvalData
from training.tracking import Tracker
from training.train import train

SETTINGS = ["train.max_steps=6", "train.log_every=2", "model.dim=16", "train.eval_every=3"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    return str(
        synthetic_shards(
            tmp_path_factory.mktemp("mlf"), users=200, items=100, seed=4, world_size=1, batch_size=16, max_len=16
        )
    )


def random_full_hr_at_10(shards: str) -> float:
    """Test HR@10 that a uniformly random full ranking scores in expectation: the target is one
    of the items left after excluding the user's inputs (eval.exclude_history), each as likely."""
    s = ShardSet(shards)
    test = EvalData(s.eval_path, s.num_items, s.max_len, EvalConfig()).splits["test"]
    hr = 0.0
    for u in range(len(test.targets)):
        excluded = set(test.values[int(test.offsets[u]) : int(test.offsets[u + 1])].tolist()) - {int(test.targets[u])}
        hr += min(1.0, 10 / (s.num_items - len(excluded)))
    return hr / len(test.targets)


def _check_run(client: MlflowClient, run_id: str, registered: bool) -> None:
    run = client.get_run(run_id)
    p = run.data.params
    assert p["model.attention"] == "sasrec" and p["data.fingerprint"] and p["topology.ranks_per_group"] == "1"
    assert run.info.status == "FINISHED"
    loss = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in loss] == [2, 4, 6]
    for key in (
        "test/full/hr_at_10",
        "test/sampled/ndcg_at_10",
        "valid/full/mrr",
        "rank0/compute_s",
        "rank0/wait_s",
        "train/tokens_per_s",
        "train/padding_fraction",
        "train/samples_per_s",
    ):
        assert key in run.data.metrics, key
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.toml", "manifest.json", "training.png"} <= names
    # the code that trained it, and the shard set it trained on
    assert run.data.tags["ftrec.version"] == importlib.metadata.version("ftrec")
    if (ROOT / ".git").exists():
        assert len(run.data.tags["ftrec.git_commit"]) == 40
    assert run.inputs is not None
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.name == "shards" and inp.dataset.digest == p["data.fingerprint"][:36]
    assert json.loads(inp.dataset.source)["uri"] == run.data.tags["ftrec.shards"]
    assert inp.dataset.profile is not None
    assert json.loads(inp.dataset.profile) == {
        "samples": 200,
        "users": 200,
        "items": int(p["data.num_items"]),
        "steps": int(p["data.steps_per_epoch"]),
    }
    # the model is a pyfunc with a signature (tests/test_training_serving.py serves it)
    (model,) = client.search_logged_models(
        experiment_ids=[run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'"
    )
    info = mlflow.models.get_model_info(model.model_uri)
    assert "python_function" in info.flavors and info.signature.params.params[0].name == "k"
    if registered:
        versions = client.search_model_versions("name='ftrec'")
        assert any(v.run_id == run_id for v in versions)


def test_embedded_store(shards, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    res = train(load_config(None, [f"data.shards={shards}", f"train.out={out}", *SETTINGS]))
    assert res["tracking_uri"] == f"sqlite:///{out}/mlflow.db" and res["mlflow_unsent"] == 0
    _check_run(MlflowClient(res["tracking_uri"]), res["mlflow_run_id"], registered=True)


def test_unreachable_server_never_stops_training(shards, tmp_path, free_port, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port}")  # nothing listens there
    res = train(
        load_config(
            None, [f"data.shards={shards}", f"train.out={tmp_path / 'run'}", *SETTINGS, "mlflow.log_model=false"]
        )
    )
    # the run trained and was evaluated: 6 steps lift HR@10 far above a random ranking's
    # (~0.11 here; 0.56-0.66 over seeds 0-3, this seed 0.605), a margin of 0.2 is ~9 sigma of 200 users
    assert res["steps"] == 6 and res["metrics"]["test/full/hr@10"] > random_full_hr_at_10(shards) + 0.2
    assert res["mlflow_run_id"] is None and res["mlflow_unsent"] > 0
    assert (tmp_path / "run" / "result.json").exists()


@pytest.mark.parametrize("enabled", [True, False])
def test_system_metrics_while_the_run_lives(tmp_path, monkeypatch, enabled):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    tracker = Tracker(MlflowConfig(experiment="sysm", system_metrics=enabled), str(tmp_path))
    tracker.log_params({"a": 1})
    deadline = time.monotonic() + 60
    while tracker.run_id is None and time.monotonic() < deadline:  # the store opens in the background
        time.sleep(0.1)
    time.sleep(1.5)
    assert tracker.close(timeout=60) == 0
    got = MlflowClient(tracker.uri).get_run(tracker.run_id).data.metrics
    system = {k for k in got if k.startswith("system/")}
    assert ("system/cpu_utilization_percentage" in system) if enabled else not system


@pytest.mark.integ
def test_real_server_with_buffered_metrics(shards, tmp_path, free_port, monkeypatch):
    uri = f"http://127.0.0.1:{free_port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    # 1. the server is not up yet: logging is buffered, nothing raises
    early = Tracker(MlflowConfig(experiment="early"), str(tmp_path))
    early.log_params({"when": "before the server"})
    early.log_metrics({"probe": 1.5}, step=1)
    early_uri_is_server = early.uri
    # 2. a real server on loopback, in its own process group, bounded
    mlflow_bin = os.path.join(os.path.dirname(sys.executable), "mlflow")
    # MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false: no /dev/shm job store left behind
    server = subprocess.Popen(
        [
            mlflow_bin,
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port),
            "--backend-store-uri",
            f"sqlite:///{tmp_path}/server.db",
            "--artifacts-destination",
            str(tmp_path / "server-artifacts"),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(0.5)
        # 3. a training run against the server
        res = train(
            load_config(
                None, [f"data.shards={shards}", f"train.out={tmp_path / 'run'}", *SETTINGS, "mlflow.register=true"]
            )
        )
        assert res["tracking_uri"] == uri and res["mlflow_unsent"] == 0
        client = MlflowClient(uri)
        _check_run(client, res["mlflow_run_id"], registered=True)
        # 4. the buffered early metrics reach the server once it is up
        assert early_uri_is_server == uri
        assert early.close(timeout=60) == 0
        got = client.get_run(early.run_id)
        assert got.data.metrics["probe"] == 1.5 and got.data.params["when"] == "before the server"
    finally:
        os.killpg(server.pid, 9)
        server.wait(timeout=30)


def test_a_group_killed_while_its_run_was_created_is_found_again_by_its_token(tmp_path, monkeypatch):
    """The run file names a run that was being created ("pending:" and a token) when group 0
    died: the restarted group finds that run by its tag instead of opening a second one, and
    records its id (the job's result and the tests read the file)."""
    from training import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = Tracker(MlflowConfig(experiment="pending"), str(tmp_path))
    first.log_params({"a": 1})
    assert first.close(timeout=60) == 0
    made = MlflowClient(first.uri).get_run(first.run_id)
    token = made.data.tags[tracking.TOKEN_TAG]
    (tmp_path / tracking.RUN_FILE).write_text(tracking.PENDING + token)  # as if killed before the id was written
    again = Tracker(MlflowConfig(experiment="pending"), str(tmp_path), continue_recorded=True)
    again.log_params({"b": 2})
    assert again.close(timeout=60) == 0
    assert again.run_id == first.run_id
    runs = MlflowClient(first.uri).search_runs([made.info.experiment_id])
    assert len(runs) == 1 and runs[0].data.params == {"a": "1", "b": "2"}
    assert (tmp_path / tracking.RUN_FILE).read_text() == first.run_id
