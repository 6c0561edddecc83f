"""Early stopping with patience (eval.patience): the rule's table, a real run that stops on a
plateau and ends with the best validated weights (result.json, OUT/best, MLflow), and two
replica groups under ftcore, one killed and healed, that stop on the same step."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_launch, synthetic_shards

from training import checkpoint
from training.config import ConfigError, load_config
from training.selection import Record, judge, make_selection, selection_metric
from training.train import train


@pytest.mark.parametrize(
    "record, value, step, patience, want",
    [
        (Record(), 0.1, 10, 2, Record(0.1, 10, 0, 0)),  # the first validation is the best so far
        (Record(0.1, 10, 0, 0), 0.2, 20, 2, Record(0.2, 20, 0, 0)),  # better: new best, count reset
        (Record(0.2, 20, 0, 0), 0.2, 30, 2, Record(0.2, 20, 1, 0)),  # a tie is no improvement
        (Record(0.2, 20, 1, 0), 0.15, 40, 2, Record(0.2, 20, 2, 40)),  # the patience-th stale one stops
        (Record(0.2, 20, 1, 0), 0.25, 40, 2, Record(0.25, 40, 0, 0)),  # better in time: goes on
        (Record(0.2, 20, 5, 0), 0.1, 70, 0, Record(0.2, 20, 6, 0)),  # patience 0: never stops
        (Record(0.2, 20, 0, 0), 0.1, 30, 1, Record(0.2, 20, 1, 30)),
    ],
)
def test_the_rule(record, value, step, patience, want):
    assert judge(record, value, step, patience) == want
    assert Record.from_tensor(want.as_tensor()) == want  # what a group's ranks share


def test_settings(tmp_path):
    base = [f"data.shards={tmp_path}"]
    assert selection_metric(load_config(None, base).eval) == ""  # defaults: no selection, no stop
    # patience alone selects on the full ranking the gate judges, not a sampled metric
    assert selection_metric(load_config(None, [*base, "eval.patience=3"]).eval) == "valid/full/ndcg@10"
    cfg = load_config(None, [*base, "eval.patience=3", "eval.best_metric=valid/full/hr@10"])
    assert selection_metric(cfg.eval) == "valid/full/hr@10"
    with pytest.raises(ConfigError, match="eval.patience must be >= 0"):
        load_config(None, [*base, "eval.patience=-1"])
    with pytest.raises(ConfigError, match="eval.patience=2 needs eval.periodic=true"):
        load_config(None, [*base, "eval.patience=2", "eval.periodic=false"])
    # a metric validation does not report is refused before training, on every rank alike
    with pytest.raises(ConfigError, match=r"'valid/full/ndcg@10' \(eval.patience's default\) is not a validation"):
        make_selection(load_config(None, [*base, "eval.patience=2", "eval.ks=[5]"]).eval)
    with pytest.raises(ConfigError, match="choose one of .*valid/full/ndcg@5"):
        make_selection(load_config(None, [*base, "eval.best_metric=valid/full/ndgc@5", "eval.ks=[5]"]).eval)


@pytest.fixture(scope="module")
def plateau(tmp_path_factory) -> Path:
    # seeded and deterministic: on this data, at a high lr with no dropout, the full-ranking
    # NDCG peaks within a few epochs and stays below it
    return synthetic_shards(
        tmp_path_factory.mktemp("plateau"),
        users=200,
        items=90,
        seed=0,
        world_size=2,
        batch_size=8,
        max_len=20,
    )


SETTINGS = [
    "model.dim=16",
    "loss.kind=sampled_softmax",
    "loss.num_negatives=16",
    "model.dropout=0",
    "optim.lr=0.01",
    "eval.patience=2",
]


def _epoch(shards: Path) -> int:
    return int(json.loads((shards / "manifest.json").read_text())["steps"])


def test_stops_on_a_plateau_and_keeps_the_best_weights(plateau, tmp_path):
    out, e = tmp_path / "run", _epoch(plateau)
    settings = [*SETTINGS, "train.epochs=12", f"train.checkpoint_every={e}", "train.keep_checkpoints=0"]
    settings += ["mlflow.log_model=false", "mlflow.plots=false", "mlflow.system_metrics=false"]
    res = train(load_config(None, [f"data.shards={plateau}", f"train.out={out}", *settings]))
    best, stop = res["best"], res["early_stop"]
    assert best["metric"] == "valid/full/ndcg@10"
    # stopped two validations (once an epoch) after the peak, long before 12 epochs
    assert stop["step"] == res["steps"] == best["step"] + 2 * e < 12 * e
    assert "did not improve" in stop["reason"] and "eval.patience=2" in stop["reason"]
    # the run's model (result.json, what is tested, logged and registered) is the best one:
    # bitwise the weights the run had at that step (its checkpoint), not the last
    assert Path(res["checkpoint"]).parent.name == "best"
    chosen = checkpoint.load(res["checkpoint"])["model"]
    at_best = checkpoint.load(checkpoint.step_dir(str(out / "checkpoints"), best["step"]))["model"]
    last = checkpoint.load(best["last_checkpoint"])["model"]
    assert all(torch.equal(chosen[k], at_best[k]) for k in at_best)
    assert any(not torch.equal(chosen[k], last[k]) for k in last)
    assert best["value"] == res["metrics"]["valid/full/ndcg@10"]  # re-scored at the end: the same
    # MLflow: the validation curve, the stop as an event on it, and why, as tags
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=res["tracking_uri"])
    run = client.get_run(res["mlflow_run_id"])
    curve = client.get_metric_history(run.info.run_id, "valid/full/ndcg_at_10")
    assert sorted(m.step for m in curve)[:-1] == list(range(e, stop["step"] + 1, e))  # + the end's
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/early_stop")] == [stop["step"]]
    tags = run.data.tags
    assert tags["ftrec.early_stop_step"] == str(stop["step"]) and tags["ftrec.best_step"] == str(best["step"])
    assert tags["ftrec.early_stop_reason"] == stop["reason"]
    # a resumed run knows the verdicts so far: the checkpoint carries the record and the weights
    sel = checkpoint.load(best["last_checkpoint"])["selection"]
    assert (sel["step"], sel["stopped_at"]) == (best["step"], stop["step"])
    assert all(torch.equal(sel["weights"][k], at_best[k]) for k in at_best)
    # resumed one validation before the stop, the run stops where it did with the same best model
    shutil.rmtree(best["last_checkpoint"])
    shutil.rmtree(out / "best")
    again = train(load_config(None, [f"data.shards={plateau}", f"train.out={out}", *settings, "train.resume=true"]))
    assert (again["steps"], again["early_stop"], again["best"]["step"]) == (res["steps"], stop, best["step"])
    chosen_again = checkpoint.load(again["checkpoint"])["model"]
    assert all(torch.equal(chosen_again[k], at_best[k]) for k in at_best)


@pytest.mark.integ
@pytest.mark.slow
def test_two_replica_groups_stop_on_the_same_step_after_a_heal(plateau, tmp_path):
    """Group 1 is killed after the peak and heals from group 0: the record it
    receives makes it stop where group 0 does (an epoch's end, 2 validations after the peak),
    and both end with one state."""
    out, e = tmp_path / "ft", _epoch(plateau)
    settings = [*SETTINGS, "train.epochs=12", "mlflow.enabled=false", "eval.batch_size=256"]
    r = run_launch(
        out,
        240,
        shards=plateau,
        faults=[{"kind": "kill", "group": 1, "at_step": 90}],
        timeout=200,
        worker_args=["--set", *settings],
    )
    assert r.returncode == 0, r.stdout[-5000:]
    assert (out / "replica_0" / "state.safetensors").read_bytes() == (
        out / "replica_1" / "state.safetensors"
    ).read_bytes()
    res = json.loads((out / "replica_0" / "result.json").read_text())
    stop = res["early_stop"]
    assert stop["step"] == res["steps"] < 12 * e and stop["step"] % e == 0
    assert res["best"]["step"] == stop["step"] - 2 * e
    assert Path(res["checkpoint"]).parent.name == "best"
    tl = json.loads((out / "timeline.json").read_text())
    assert any(e["kind"] == "heal_finished" and e["group"] == 1 for e in tl["lighthouse_events"])
    # the one restart is the kill's: a healed group without its peers' verdicts trains on
    # where they stop, the schedule disagrees with FTAR and the groups fail
    assert tl["restarts"]["1"] == 1 and tl["restarts"].get("0", 0) == 0, tl["restarts"]


def test_periodic_validation_on_a_sample_of_users(plateau, tmp_path):
    """eval.valid_users: validations (and what they select and stop on) score a fixed sample of
    users; the end scores all of them."""
    from training.config import EvalConfig
    from training.evaluate import EvalData, evaluate
    from training.model import SeqRec

    path = str(plateau / "eval.parquet")
    a, b = (EvalData(path, 90, 20, EvalConfig(), sample=60) for _ in range(2))
    assert len(a.splits["valid"].targets) == 60 and torch.equal(a.splits["valid"].targets, b.splits["valid"].targets)
    out, e = tmp_path / "run", _epoch(plateau)
    settings = [*SETTINGS, "train.epochs=12", "mlflow.enabled=false", "eval.valid_users=60"]
    res = train(load_config(None, [f"data.shards={plateau}", f"train.out={out}", *settings]))
    assert res["early_stop"]["step"] == res["steps"] < 12 * e
    sel = checkpoint.load(res["best"]["last_checkpoint"])["selection"]
    cfg = load_config(None, [f"data.shards={plateau}", "model.dim=16", "model.max_len=20"])
    model = SeqRec(90, cfg.model)
    model.load_state_dict(checkpoint.load(res["checkpoint"])["model"])
    # the record is the sample's figure for the chosen model; the result, all users'
    assert sel["value"] == evaluate(model, a, cfg.eval, splits=("valid",))["valid/full/ndcg@10"]
    full = evaluate(model, EvalData(path, 90, 20, cfg.eval), cfg.eval, splits=("valid",))["valid/full/ndcg@10"]
    assert res["best"]["value"] == full != sel["value"]
