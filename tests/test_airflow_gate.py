"""The retrain gate judges champion and challenger on equal tests.

Real small models are trained on synthetic data (real trainer, real MLflow store, the real
`python -m training.gate` subprocess); the evaluate and register_model task bodies
(ftrec_airflow.tasks) run with a minimal Airflow task context. The data of the retrain
is shifted (another seed): the champion was trained on the old data, and its stored
`gate_value` comes from another test. The gate must ignore that number.
"""

import logging
from collections import defaultdict
from types import SimpleNamespace

import pytest

from dataprep.build import build_shards
from dataprep.synth import write_synthetic
from ftrec_airflow import mlflow_registry, pipeline_ops, run_params, tasks
from training.config import load_config
from training.train import train

METRIC, SAMPLED = "test/full/ndcg_at_10", "test/sampled/ndcg_at_10"
LR0 = ["optim.lr=0", "optim.embedding_lr=0"]


def _shards(d) -> tuple[str, str]:
    """Old and new data: one item world (popularity, successors), the users split in two."""
    src = d / "events.txt"
    write_synthetic(str(src), users=600, items=80, seed=1, median_len=10, max_history=40, markov=0.8)
    lines = src.read_text().splitlines()
    out = []
    for part, keep in (("old", lambda u: u % 2 == 0), ("new", lambda u: u % 2 == 1)):
        (d / f"{part}.txt").write_text("\n".join(ln for ln in lines if keep(int(ln.split()[0]))) + "\n")
        build_shards(str(d / f"{part}.txt"), "sasrec", str(d / part), world_size=1, batch_size=16, max_len=16)
        out.append(str(d / part))
    return out[0], out[1]


def _train(d, shards: str, name: str, uri: str, extra=()) -> dict:
    sets = [
        f"data.shards={shards}",
        f"train.out={d / name}",
        "train.max_steps=60",
        "model.dim=16",
        "loss.kind=sampled_softmax",
        "loss.num_negatives=16",
        "eval.periodic=false",
        "mlflow.plots=false",
        "mlflow.system_metrics=false",
        "mlflow.register=false",
        f"mlflow.tracking_uri={uri}",
        *extra,
    ]
    res = train(load_config(None, sets))
    return {k: res[k] for k in ("mlflow_run_id", "tracking_uri", "checkpoint")} | {"shards": shards}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("gate")
    uri = f"sqlite:///{d / 'mlflow.db'}"
    old, new = _shards(d)
    return {
        "dir": d,
        "uri": uri,
        "new": new,
        "good_old": _train(d, old, "good-old", uri),  # trained on the old data
        "lr0_new": _train(d, new, "lr0-new", uri, LR0),  # its initial weights, on the new data
        "good_new": _train(d, new, "good-new", uri),
    }


@pytest.fixture
def task(monkeypatch, tmp_path):
    """The Airflow task context the task bodies read (run folder, outlet events)."""
    monkeypatch.setenv("FTREC_WORK", str(tmp_path / "work"))
    monkeypatch.delenv("AIRFLOW_CONN_FTREC_MLFLOW", raising=False)
    ctx = {"ti": SimpleNamespace(dag_id="ftrec_retrain"), "run_id": "r", "outlet_events": defaultdict(SimpleNamespace)}
    monkeypatch.setattr(tasks, "get_current_context", lambda: ctx)
    return ctx


def _champion(uri: str, name: str, trained: dict, stored: float) -> int:
    """A champion as an earlier gate left it: its checkpoint and a gate_value from another test."""
    c = mlflow_registry.client(uri)
    c.create_registered_model(name)
    tags = {"gate_metric": METRIC, "gate_value": repr(stored), mlflow_registry.CHECKPOINT_TAG: trained["checkpoint"]}
    mv = c.create_model_version(name, source=f"runs:/{trained['mlflow_run_id']}/model", run_id=None, tags=tags)
    c.set_registered_model_alias(name, mlflow_registry.CHAMPION, mv.version)
    return int(mv.version)


def _retrain(name: str, trained: dict, caplog, run_id: str = "r", **extra) -> tuple[dict, dict]:
    p = {"model_name": name, "gate_metric": METRIC, "gate_min": 0.0, "gate_min_margin": run_params.GATE_MIN_MARGIN}
    p |= extra
    with caplog.at_level(logging.INFO, logger="ftrec_airflow.tasks"):
        ev = tasks.evaluate(trained, params=p)
        return ev, tasks.register_model(trained, ev, params=p)


def test_an_lr0_challenger_loses_although_the_champions_stored_score_is_lower(world, task, caplog):
    uri, name = world["uri"], "recs-a"
    v1 = _champion(uri, name, world["good_old"], stored=0.0)  # scored 0 on its old test
    ev, reg = _retrain(name, world["lr0_new"], caplog)
    new, champ = reg["scores"]["challenger"][METRIC], reg["scores"]["champion"][METRIC]
    assert new > 0.0  # the old gate (new score vs stored 0.0) would have promoted it
    assert champ > new + run_params.GATE_MIN_MARGIN, reg["scores"]
    assert (reg["version"], reg["champion"], reg["promoted"], reg["aliases"]) == (2, v1, False, ["challenger"])
    assert int(mlflow_registry.client(uri).get_model_version_by_alias(name, mlflow_registry.CHAMPION).version) == v1
    # both scores, on both protocols, the split and the verdict: on the run and in the task log
    run = mlflow_registry.client(uri).get_run(world["lr0_new"]["mlflow_run_id"]).data
    assert run.metrics[f"gate/challenger/{METRIC}"] == new and run.metrics[f"gate/champion/{METRIC}"] == champ
    assert f"gate/champion/{SAMPLED}" in run.metrics and f"gate/challenger/{SAMPLED}" in run.metrics
    fp = pipeline_ops.check_shards(world["new"])["fingerprint"]
    assert ev["split"]["fingerprint"] == fp == run.tags["gate.split_fingerprint"] and len(fp) == 64
    assert (run.params["gate.split"], run.params["gate.split_cut"]) == ("leave_one_out", "")  # sasrec: no times
    assert run.tags["gate.verdict"] == "kept champion" and run.tags["gate.champion_version"] == str(v1)
    said = caplog.text
    assert f"gate: champion {METRIC} = {champ:.6f}" in said and f"gate: challenger {METRIC} = {new:.6f}" in said
    assert f"split fingerprint {fp}" in said and "gate verdict: kept champion" in said
    assert "judged on this run's leave_one_out split" in said


def test_a_better_challenger_wins_although_the_champions_stored_score_is_higher(world, task, caplog):
    uri, name = world["uri"], "recs-b"
    _champion(uri, name, world["lr0_new"], stored=1.0)  # a perfect score on some other test
    _, reg = _retrain(name, world["good_new"], caplog)
    assert reg["scores"]["challenger"][METRIC] > reg["scores"]["champion"][METRIC] + run_params.GATE_MIN_MARGIN
    assert (reg["champion"], reg["promoted"], reg["aliases"]) == (2, True, ["challenger", "champion"])
    assert "gate verdict: promoted" in caplog.text


def test_with_approval_a_winner_waits_for_approve_and_a_retry_asks_nothing(world, task, caplog):
    """champion_approval: the better challenger stays challenger until approve_champion's answer
    (here Approve, as Airflow's HITL hands it on); the production tier answers one in Airflow."""
    from ftrec_airflow import approval

    uri, name = world["uri"], "recs-d"
    v1 = _champion(uri, name, world["lr0_new"], stored=1.0)
    asked = {"champion_approval": True, "champion_approval_hours": 0.5}
    _, reg = _retrain(name, world["good_new"], caplog, **asked)
    assert (reg["champion"], reg["promoted"], reg["aliases"]) == (v1, False, ["challenger"])
    assert reg["approval"]["asked"] and reg["approval"]["judged"] == v1 and "approved" in reg["reason"]
    run = mlflow_registry.client(uri).get_run(world["good_new"]["mlflow_run_id"]).data
    assert run.tags["gate.verdict"] == "awaiting approval" and "gate verdict: awaiting approval" in caplog.text
    question = approval.body(reg)
    assert f"| challenger | {reg['scores']['challenger'][METRIC]:.6f}" in question and "no answer in 0.5 h" in question
    answer = {"chosen_options": ["Approve"], "responded_by_user": {"id": "7", "name": "alice"}}
    task["ti"].xcom_pull = lambda task_ids: answer if task_ids == "approve_champion" else None
    done = tasks.promote_champion(reg)
    assert (done["champion"], done["promoted"], done["approved_by"]) == (2, True, "alice")
    c = mlflow_registry.client(uri)
    assert c.get_model_version_by_alias(name, mlflow_registry.CHAMPION).tags["champion_approved_by"] == "alice"
    _, again = _retrain(name, world["good_new"], caplog, **asked)  # the task re-run: nothing left to approve
    assert again["approval"]["asked"] is False and again["champion"] == 2
    assert tasks.promote_champion(again)["asked"] is False


def test_the_same_model_is_scored_the_same_as_champion_and_as_challenger(world):
    """One code path for both: the champion's score of a model equals its challenger score,
    and equals what the trainer itself logged at the end of training."""
    got = pipeline_ops.judge(
        world["good_new"]["checkpoint"],
        world["new"],
        str(world["dir"] / "self.json"),
        champion=world["good_new"]["checkpoint"],
    )
    assert got["champion"] == {k: v for k, v in got["metrics"].items() if k.startswith("test/")}
    logged = mlflow_registry.run_metrics(world["good_new"]["mlflow_run_id"], world["uri"])
    assert logged[METRIC] == pytest.approx(got["metrics"]["test/full/ndcg@10"], abs=1e-6)


def test_a_champion_that_cannot_be_scored_is_kept(world, task, caplog, tmp_path):
    uri, name = world["uri"], "recs-c"
    _champion(uri, name, {**world["good_old"], "checkpoint": str(tmp_path / "gone")}, stored=0.0)
    _, reg = _retrain(name, world["good_new"], caplog)
    assert (reg["champion"], reg["promoted"], reg["aliases"]) == (1, False, ["challenger"])
    assert "could not be scored" in reg["reason"] and "is gone" in reg["reason"]


@pytest.mark.parametrize(
    "new,champ,margin,error,won",
    [
        (0.30, None, 0.001, None, True),
        (0.30, 0.2995, 0.001, None, False),  # better, but within the margin
        (0.30, 0.25, 0.001, None, True),
        (0.30, 0.30, 0.0, None, False),  # a tie keeps the champion
        (0.90, 0.10, 0.001, "checkpoint gone", False),
    ],
)
def test_verdict_table(new, champ, margin, error, won):
    assert pipeline_ops.verdict(new, champ, margin, error)[0] is won


def test_the_gate_cli_says_what_is_wrong_without_a_traceback(world, tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "training.gate", "--shards", world["new"], "--challenger", str(tmp_path / "nope")]
        + ["--out", str(tmp_path / "o.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "nope" in r.stderr, r.stderr
    assert not (tmp_path / "o.json").exists()
