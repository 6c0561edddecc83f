"""One MLflow run per job with several replica groups: 2 groups x 2 ranks under the launcher,
logging into one run created beforehand (as the Airflow task does). Exactly one value per
(metric, step), exactly one logged model, the registered version is that model, and each
group's own facts arrive as group<g>/... metrics."""

import collections

import pytest
from conftest import cli_shard_set, run_launch
from mlflow import MlflowClient

pytestmark = [pytest.mark.integ, pytest.mark.slow]


def test_two_groups_of_two_ranks_log_one_value_per_metric_and_step_and_one_model(tmp_path):
    shards, out = cli_shard_set(tmp_path, world_size=4), tmp_path / "run"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("groups", artifact_location=(tmp_path / "artifacts").as_uri())  # not ./mlruns
    run_id = client.create_run(exp).info.run_id
    r = run_launch(
        out,
        360,
        shards=shards,
        ranks=2,
        timeout=300,
        worker_args=[
            "--set",
            "train.epochs=2",
            "model.dim=16",
            "loss.kind=sampled_softmax",
            "loss.num_negatives=16",
            "train.log_every=2",
            f"mlflow.run_id={run_id}",
            f"mlflow.tracking_uri={uri}",
            "mlflow.register=true",
            "mlflow.model_name=groups-2x2",
            "mlflow.plots=false",
            "eval.batch_size=256",
        ],
    )
    assert r.returncode == 0, r.stdout[-4000:]
    run = client.get_run(run_id)
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        dup = [s for s, n in collections.Counter(steps).items() if n > 1]
        assert not dup, f"{key}: more than one value at step(s) {dup[:5]}"
    assert len(client.get_metric_history(run_id, "train/loss")) >= 2
    # the cross-group FTAR wait, split: waiting for the slowest group, and the transfer itself
    for key in ("ft/straggler_s", "ft/transfer_s", "ft/bubble_fraction"):
        assert all(m.value >= 0 for m in client.get_metric_history(run_id, key)), key
    assert max(m.value for m in client.get_metric_history(run_id, "train/bubble_fraction")) > 0
    for g in (0, 1):
        assert run.data.metrics[f"group{g}/committed_steps"] > 0 and f"group{g}/restarts" in run.data.metrics
    models = client.search_logged_models(experiment_ids=[exp])
    assert len(models) == 1, [m.model_id for m in models]
    versions = client.search_model_versions("name = 'groups-2x2'")
    assert len(versions) == 1 and versions[0].run_id == run_id
    assert models[0].model_id in versions[0].source or versions[0].source.endswith("/model"), versions[0].source


def test_a_restarted_group_0_continues_the_jobs_run_instead_of_opening_another(tmp_path):
    """Without a run made beforehand (a standalone launch), group 0's rank 0 opens the run; when
    that rank is SIGKILLed and the launcher restarts the group, the new process logs into the
    same run: one run per job."""
    import json

    shards, out = cli_shard_set(tmp_path, world_size=2), tmp_path / "run"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("restart", artifact_location=(tmp_path / "artifacts").as_uri())
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"kind": "kill", "group": 0, "at_step": 3}]}))
    r = run_launch(
        out,
        360,
        shards=shards,
        faults=plan,
        timeout=300,
        worker_args=[
            "--set",
            "train.epochs=3",
            "model.dim=16",
            "loss.kind=sampled_softmax",
            "loss.num_negatives=16",
            "train.log_every=2",
            "mlflow.experiment=restart",
            f"mlflow.tracking_uri={uri}",
            "mlflow.register=false",
            "mlflow.log_model=false",
            "mlflow.plots=false",
            "mlflow.system_metrics=false",
            "eval.batch_size=256",
        ],
    )
    assert r.returncode == 0, r.stdout[-4000:]
    assert json.loads((out / "timeline.json").read_text())["restarts"]["0"] == 1
    runs = client.search_runs([exp])
    assert len(runs) == 1, [(x.info.run_id, x.info.start_time) for x in runs]
    assert (out / "replica_0" / "mlflow_run_id").read_text() == runs[0].info.run_id
