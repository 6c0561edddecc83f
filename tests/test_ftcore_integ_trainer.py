"""The real trainer on ftcore: `python -m training launch` with 2 replica groups on a real
(synthetic) shard set; one group is killed with SIGKILL mid-run, restarted from a spare,
healed, and both groups end with identical parameters and optimizer state. The batches
the killed group missed are made up (ftcore/schedule.py): the ledger shows every sample of
every epoch trained exactly once, with the ids the trainer actually read. The recovery
timeline reaches the trainer's MLflow run."""

import json
from pathlib import Path

import pytest
from conftest import cli_shard_set, helped_pieces, run_launch, shard_sample_ids

from dataprep import schema
from ftcore import ledger

pytestmark = [pytest.mark.integ, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent


def test_trainer_kill9_heal_identical_states_and_timeline_in_mlflow(tmp_path):
    shards, out = cli_shard_set(tmp_path), tmp_path / "run"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"kind": "kill", "group": 1, "at_step": 6}]}))
    settings = [
        "train.epochs=2",
        "model.dim=16",
        "loss.kind=sampled_softmax",
        "loss.num_negatives=16",
        "mlflow.log_model=false",
    ]
    settings += ["mlflow.plots=false", "eval.batch_size=256"]
    r = run_launch(out, 260, shards=shards, faults=plan, timeout=220, worker_args=["--set", *settings])
    assert r.returncode == 0, r.stdout[-5000:]
    s0 = (out / "replica_0" / "state.safetensors").read_bytes()
    s1 = (out / "replica_1" / "state.safetensors").read_bytes()
    assert s0 == s1, "the healed group ended with a different state"
    # exactly once: every (shard, row group), hence every sample id, once per epoch
    steps = json.loads((shards / schema.MANIFEST).read_text())["steps"]
    sample_ids = shard_sample_ids(shards)

    summary = ledger.check(
        str(out / "ledger"), steps_per_epoch=steps, num_groups=2, ranks_per_group=1, epochs=2, sample_ids=sample_ids
    )
    assert summary["batches"] == 2 * 2 * steps
    assert summary["makeup_steps"] >= 1, "the killed group missed no step: the make-up path was not exercised"
    # spread: the survivor trained some of the killed group's missed batches from its shards
    helped = helped_pieces(out / "ledger")
    assert helped, "every missed batch was made up by its owner alone"
    tl = json.loads((out / "timeline.json").read_text())
    assert tl["restarts"]["1"] == 1
    assert any(e["kind"] == "heal_finished" and e["group"] == 1 for e in tl["lighthouse_events"])
    assert "[g1r0]" in r.stdout and "[g0r0]" in r.stdout  # log lines carry group and rank

    import mlflow

    res = json.loads((out / "replica_0" / "result.json").read_text())
    run_ = mlflow.MlflowClient(tracking_uri=res["tracking_uri"]).get_run(res["mlflow_run_id"])
    assert run_.data.metrics["ft/heals"] >= 1
    arts = [a.path for a in mlflow.MlflowClient(tracking_uri=res["tracking_uri"]).list_artifacts(res["mlflow_run_id"])]
    assert "timeline.json" in arts
