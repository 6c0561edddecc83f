"""`dag.test()` of ftrec_train on small synthetic data, through the same entry point as
`make run` (python -m ftrec_airflow.local_run): real Airflow metadata DB (SQLite), real
MLflow store, real dataprep and training processes.

One DAG run is made, then made again with the same logical date (every task re-runs in
the same DAG run, as retries do); then its register_model runs once more with a quality
gate the model cannot pass. A second DAG run trains a worse model (learning rate 0: the
untrained initial weights), which becomes challenger but not champion; ftrec_retrain then
warm-starts from the champion, not from that newest version.
"""

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("AIRFLOW_HOME", str(ROOT / "work" / "test-airflow-home"))

pytestmark = pytest.mark.slow
FULL = "test/full/ndcg_at_10"  # the gate's default metric
GATE_MIN_MARGIN = 0.001
SEAL = "build_shards.seal"  # the fanned-out build_shards group's last task: the shard set's summary

# group 0 is paced after the kill, so the restarted group 1 is back (and heals) before the
# 10-step budget runs out: unpaced steps of this tiny model take ~25 ms
PLAN = {
    "faults": [
        {"kind": "kill", "group": 1, "at_step": 4},
        {"kind": "slow", "group": 0, "at_step": 4, "until_step": 10, "delay_s": 0.25},
    ]
}


def sets(*items: str) -> list[str]:
    return [w for item in items for w in ("--set", item)]


# params.KEY is a DAG param; a trainer setting (model.dim=16) joins the train_overrides param
SMALL = [
    *sets(
        "params.data_source=synthetic",
        "params.synth_users=240",
        "params.synth_items=120",
        "params.max_steps=10",
        "params.batch_size=16",
        "params.max_len=20",
        "params.replica_groups=2",
        "params.shard_buckets=2",
        "model.dim=16",
        "eval.batch_size=256",
    ),
    "--conf",
    json.dumps({"fault_plan": json.dumps(PLAN)}),
]
DATE = "2026-01-02T00:00:00+00:00"


def local_run(work: Path, *args: str, timeout: float = 400) -> tuple[int, dict | None, str]:
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("FTREC_WORK", None)
    r = subprocess.run(
        [sys.executable, "-m", "ftrec_airflow.local_run", "--work", str(work), "--timeout", str(timeout - 30), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    summary = work / "last_run.json"
    return r.returncode, json.loads(summary.read_text()) if summary.exists() else None, r.stdout + r.stderr


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ftrec-work")


@pytest.fixture(scope="module")
def first(work):
    rc, summary, out = local_run(work, "--logical-date", DATE, *SMALL)
    assert rc == 0 and summary, out[-4000:]
    return summary, out


def _client(work: Path):
    from ftrec_airflow import mlflow_registry

    return mlflow_registry.client(f"sqlite:///{work / 'mlflow' / 'mlflow.db'}")


def test_dag_run_succeeds_and_reports(first, work):
    summary, out = first
    assert summary["state"].endswith("success")
    assert set(summary["tasks"].values()) == {"success"}
    # build_shards as mapped tasks: one input file, two buckets (the shard_buckets param), two
    # ranks (R=2)
    assert sorted(t for t in summary["tasks"] if t.startswith("build_shards.")) == [
        "build_shards.bucket[0]",
        "build_shards.bucket[1]",
        "build_shards.ids",
        "build_shards.partition[0]",
        "build_shards.plan",
        "build_shards.prepare",
        "build_shards.read[0]",
        "build_shards.route[0]",
        "build_shards.route[1]",
        "build_shards.seal",
        "build_shards.write[0]",
        "build_shards.write[1]",
    ]
    others = {t for t in summary["tasks"] if not t.startswith("build_shards.")}
    assert others == {
        "ingest_validate",
        "verify_shards",
        "train",
        "evaluate",
        "register_model",
        "approve_champion",
        "promote_champion",
    }
    assert summary["xcom"]["approve_champion"] == {"asked": False}  # champion_approval is off: nobody asked
    assert summary["xcom"]["promote_champion"] == {"asked": False, "champion": 1, "promoted": True}
    assert "test/sampled/ndcg_at_10" in out and "registered model: ftrec version 1" in out
    assert f"sqlite:///{work / 'mlflow' / 'mlflow.db'}" in out
    assert "mlflow ui --backend-store-uri" in out and "--host 127.0.0.1" in out and "-m ftrec_airflow.ui --work" in out
    assert (work / "airflow" / "airflow.db").exists()
    # a run triggered from the UI afterwards starts: the unscheduled DAGs are unpaused, not the daily one
    with sqlite3.connect(work / "airflow" / "airflow.db") as db:
        paused = dict(db.execute("select dag_id, is_paused from dag").fetchall())
    assert paused["ftrec_train"] == 0 and paused["ftrec_chaos_drill"] == 0 and paused["ftrec_retrain"] == 1, paused
    # the shards were balanced with the trained model's own cost model, calibrated once here (a
    # noisy fit on a loaded machine is used, and kept aside under noisy/, never found again)
    assert summary["xcom"][SEAL]["cost_model"] == "calibrated:training"
    assert list((work / "cost-models").rglob("cost-*.json"))


def test_fanned_out_shards_are_the_one_process_build(first, tmp_path):
    """The shard set the mapped tasks built is the one `dataprep shards` builds in one process."""
    from test_dataprep_bucketed import _assert_same

    from dataprep.build import build_shards

    summary, _ = first
    data, out = summary["xcom"]["ingest_validate"], Path(summary["xcom"][SEAL]["path"])
    m = json.loads((out / "manifest.json").read_text())
    kw = {k: m["config"][k] for k in ("world_size", "batch_size", "max_len", "seed", "cost_model")}
    build_shards(data["path"], data["format"], str(tmp_path / "ref"), memory_budget="64GB", **kw)
    _assert_same(tmp_path / "ref", out)


def test_every_task_writes_the_log_the_ui_reads(first, work):
    """Airflow's Logs tab reads $AIRFLOW_HOME/logs/dag_id=/run_id=/task_id=/attempt=N.log,
    JSON lines it parses as StructuredLogMessage: local_run writes them for dag.test()."""
    from airflow.utils.log.file_task_handler import StructuredLogMessage

    summary, _ = first
    env = (work / "env.sh").read_text()
    assert f"AIRFLOW__CORE__PARALLELISM={max(2, os.cpu_count() or 2)}" in env
    logs = work / "airflow" / "logs" / "dag_id=ftrec_train" / f"run_id={summary['run_id']}"
    text = {}
    for task in summary["tasks"]:
        tid, _, index = task.rstrip("]").partition("[")  # a mapped task's instance: task_id[map_index]
        mapped = f"map_index={index}" if index else ""
        lines = (logs / f"task_id={tid}" / mapped / "attempt=1.log").read_text().splitlines()
        text[task] = "\n".join(StructuredLogMessage.model_validate_json(ln).event for ln in lines)
    assert "shard set" in text[SEAL] and "MLflow run" in text["train"]
    assert "dataprep bucket 0: " in text["build_shards.bucket[0]"]  # each stage's figures in its own log
    assert "gate verdict: promoted" in text["register_model"] and "gate verdict" not in text["train"]


def test_mlflow_run_metrics_and_registered_version(first, work):
    summary, _ = first
    train = summary["xcom"]["train"]
    c = _client(work)
    run = c.get_run(train["mlflow_run_id"])
    assert run.data.tags["airflow.dag_id"] == "ftrec_train" and run.data.tags["airflow.run_id"] == summary["run_id"]
    assert run.info.artifact_uri.startswith((work / "mlflow" / "artifacts").as_uri())
    m = run.data.metrics
    # the trainer's test metrics, once: evaluate logs no eval/ copy of them
    assert "train/loss" in m and 0.0 <= m["test/sampled/ndcg_at_10"] <= 1.0
    assert not [k for k in m if k.startswith("eval/")]
    assert m["test/full/hr_at_10"] == summary["xcom"]["evaluate"]["metrics"]["test/full/hr_at_10"]
    assert len(c.get_metric_history(train["mlflow_run_id"], "test/sampled/ndcg_at_10")) == 1
    # the fault plan killed replica group 1: the launcher's recovery events are on the run
    assert m["ft/failures_detected"] >= 1 and m["ft/heals"] >= 1 and m["ft/quorum_changes"] >= 1
    assert m["ft/committed_steps"] == 10
    assert "timeline.json" in [a.path for a in c.list_artifacts(train["mlflow_run_id"])]
    versions = c.search_model_versions("name = 'ftrec'")
    assert [(int(v.version), v.run_id) for v in versions] == [(1, train["mlflow_run_id"])]
    assert versions[0].tags["gate_metric"] == "test/full/ndcg_at_10"
    assert float(versions[0].tags["gate_value"]) == m["test/full/ndcg_at_10"]
    fp = summary["xcom"][SEAL]["fingerprint"]
    assert versions[0].tags["gate_split_fingerprint"] == fp == run.data.tags["gate.split_fingerprint"]
    assert run.data.tags["gate.verdict"] == "promoted" and m["gate/challenger/test/full/ndcg_at_10"] == m[FULL]
    reg = summary["xcom"]["register_model"]
    assert {k: reg[k] for k in ("name", "version", "run_id", "reused", "champion", "promoted", "aliases")} == {
        "name": "ftrec",
        "version": 1,
        "run_id": train["mlflow_run_id"],
        "reused": False,
        "champion": 1,
        "promoted": True,
        "aliases": ["challenger", "champion"],
    }  # the first version is champion
    links = summary["links"]["train"]
    assert links["MLflowRunLink"].endswith(f"/runs/{train['mlflow_run_id']}")
    assert "/ftrec/lighthouse/?dag_id=ftrec_train" in links["LighthouseLink"]


def test_rerunning_every_task_duplicates_nothing(first, work):
    summary, _ = first
    run_id = summary["xcom"]["train"]["mlflow_run_id"]
    c = _client(work)
    exp = c.get_experiment_by_name("ftrec").experiment_id
    loss_points = len(c.get_metric_history(run_id, "train/loss"))
    rc, again, out = local_run(work, "--logical-date", DATE, *SMALL)
    assert rc == 0, out[-3000:]
    assert again["run_id"] == summary["run_id"]  # the same DAG run, every task run a second time
    assert again["xcom"][SEAL]["reused"] is True
    assert again["xcom"]["train"]["reused"] is True and again["xcom"]["train"]["mlflow_run_id"] == run_id
    assert again["xcom"]["register_model"]["reused"] is True
    assert len(c.search_runs([exp])) == 1  # no second MLflow run
    assert len(c.get_metric_history(run_id, "train/loss")) == loss_points
    assert len(c.get_metric_history(run_id, "test/full/hr_at_10")) == 1
    assert [int(v.version) for v in c.search_model_versions("name = 'ftrec'")] == [1]
    assert again["xcom"]["register_model"]["champion"] == 1 and again["xcom"]["register_model"]["aliases"] == [
        "challenger",
        "champion",
    ]


def test_quality_gate_fails_on_purpose(first, work):
    """register_model of the same DAG run again, with a gate the model cannot pass
    (`airflow tasks test -t`): the task fails, names every metric, registers nothing."""
    summary, _ = first
    env = {
        **os.environ,
        **{
            k: v
            for k, v in (
                line.removeprefix("export ").split("=", 1)
                for line in (work / "env.sh").read_text().splitlines()
                if line.startswith("export ") and not line.startswith("export PATH=")
            )
        },
    }
    env = {k: v.strip("'") for k, v in env.items()}
    r = subprocess.run(
        [
            str(Path(sys.executable).parent / "airflow"),
            "tasks",
            "test",
            "ftrec_train",
            "register_model",
            summary["run_id"],
            "-t",
            json.dumps({"gate_min": 1.5}),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = r.stdout + r.stderr
    assert "AirflowFailException: quality gate failed: test/full/ndcg_at_10=" in out, out[-3000:]
    assert "< 1.5" in out and "test/full/hr_at_10=" in out  # every metric is in the message
    assert [int(v.version) for v in _client(work).search_model_versions("name = 'ftrec'")] == [1]


def test_a_dag_run_whose_ledger_shows_a_batch_trained_twice_ends_failed(first, work):
    """The same DAG run again with a step planted in its ledger that trains step 0's batches a
    second time: train (its result reused) fails on the ledger check at once, without retries,
    nothing downstream runs, the DAG run ends failed and no version is registered."""
    summary, _ = first
    ledger = Path(summary["xcom"]["train"]["out"]) / "ledger"
    records = [json.loads(x) for x in (ledger / "group-000-rank-000.jsonl").read_text().splitlines()]
    step0, last = next(r for r in records if r.get("step") == 0), max(r.get("step", -1) for r in records)
    planted = ledger / "group-000-rank-009.jsonl"
    planted.write_text(json.dumps({**step0, "step": last + 1}) + "\n")
    try:
        rc, again, out = local_run(work, "--logical-date", DATE, *SMALL)
    finally:
        planted.unlink()
    assert rc != 0 and again and again["state"].endswith("failed"), out[-3000:]
    assert again["tasks"]["train"].endswith("failed") and not again["tasks"]["register_model"].endswith("success")
    assert "ledger check failed in" in out and "trained twice" in out, out[-3000:]
    assert [int(v.version) for v in _client(work).search_model_versions("name = 'ftrec'")] == [1]


def test_chaos_drill_checks_recovery(work):
    """ftrec_chaos_drill, small: kill replica group 1, then the lighthouse."""
    # 80 steps: the restarted group is back (a warm spare, ~0.3 s; seconds on a loaded machine) and
    # heals long before the budget ends
    plan = {
        "faults": [
            {"kind": "kill", "group": 1, "at_step": 4},
            {"kind": "kill_lighthouse", "at_step": 8, "duration_s": 1},
        ]
    }
    rc, summary, out = local_run(
        work,
        "--dag",
        "ftrec_chaos_drill",
        *sets("params.synth_users=240", "params.max_steps=80", "params.max_len=20"),
        "--conf",
        json.dumps({"train_overrides": ["model.dim=16", "eval.batch_size=256"], "fault_plan": json.dumps(plan)}),
    )
    assert rc == 0, out[-4000:]
    verdict = summary["xcom"]["check_recovery"]
    assert verdict["ok"] is True and verdict["faulted"] == [1] and verdict["survivors"] == [0]
    assert len(set(verdict["checksums"].values())) == 1 and len(verdict["checksums"]) == 2
    assert verdict["recovery_metrics"]["ft/failures_detected"] >= 1
    kinds = [
        e["kind"]
        for e in json.loads((Path(summary["run_folder"]) / "train" / "timeline.json").read_text())["launcher_events"]
    ]
    assert "lighthouse_restarted" in kinds and "group_failed" in kinds
    snap = json.loads((Path(summary["run_folder"]) / "lighthouse.json").read_text())
    assert snap["url"].startswith("http://127.0.0.1:") and snap["status"]["max_step"] >= 1


def model_events(work: Path) -> list[dict]:
    """The `ftrec_model` Asset events in the Airflow metadata DB, oldest first."""
    with sqlite3.connect(work / "airflow" / "airflow.db") as db:
        rows = db.execute(
            "SELECT e.extra, e.source_dag_id FROM asset_event e JOIN asset a ON a.id = e.asset_id "
            "WHERE a.name = 'ftrec_model' ORDER BY e.id"
        ).fetchall()
    return [{**json.loads(extra), "dag": dag} for extra, dag in rows]


# No fault plan: these runs are about the registry, not about recovery.
PLAIN = [*SMALL[:-2], *sets("params.fault_plan=")]
LR0 = ["optim.lr=0", "optim.embedding_lr=0"]


@pytest.fixture(scope="module")
def worse(first, work):
    """A second ftrec_train run whose model keeps its initial weights."""
    rc, summary, out = local_run(work, *PLAIN, "--conf", json.dumps({"train_overrides": LR0}))
    assert rc == 0 and summary, out[-4000:]
    return summary, out


def test_a_worse_version_is_challenger_and_the_champion_stays(first, worse, work):
    c = _client(work)
    reg1, reg2 = first[0]["xcom"]["register_model"], worse[0]["xcom"]["register_model"]
    # the same data (same seed): the champion, re-scored on the second run's split, scores as it did
    assert reg2["scores"]["champion"][FULL] == pytest.approx(reg1["gate_value"], abs=1e-9)
    assert reg2["version"] == 2 and reg2["gate_value"] < reg2["scores"]["champion"][FULL], (reg1, reg2)
    assert (reg2["champion"], reg2["promoted"], reg2["aliases"]) == (1, False, ["challenger"])
    assert "gate verdict: kept champion" in worse[1] and "the champion is version 1" in worse[1]
    assert int(c.get_model_version_by_alias("ftrec", "champion").version) == 1
    assert int(c.get_model_version_by_alias("ftrec", "challenger").version) == 2
    # each registration is an event on the ftrec_model Asset (the first run's re-run made a second one)
    events = [e for e in model_events(work) if e["dag"] == "ftrec_train"]
    assert [(e["version"], e["aliases"], e["champion"]) for e in events] == [
        (1, ["challenger", "champion"], 1),
        (1, ["challenger", "champion"], 1),
        (2, ["challenger"], 1),
    ]
    assert events[-1]["run_id"] == worse[0]["xcom"]["train"]["mlflow_run_id"] and events[-1]["name"] == "ftrec"
    assert events[-1]["gate_metric"] == FULL and events[-1]["gate_value"] == reg2["gate_value"]


def _gate(summary: dict, work: Path) -> tuple[dict, dict]:
    """register_model's result and the gate's tags on the run's MLflow run."""
    reg = summary["xcom"]["register_model"]
    return reg, _client(work).get_run(summary["xcom"]["train"]["mlflow_run_id"]).data.tags


def test_a_retrain_warm_starts_from_the_champion_and_judges_both_on_its_own_shifted_test(first, worse, work):
    """ftrec_retrain end to end, on new data (another seed: other users, other item popularity):
    base_model resolves models:/ftrec@champion (version 1, not the newest version 2), its
    training starts from version 1's checkpoint and keeps its weights (lr 0). It re-scores the
    champion on its own new test split: both scores carry that split's fingerprint, not the
    first run's, and the verdict follows them, never a stored score: version 3 is registered as
    challenger, not promoted."""
    champion_ckpt = first[0]["xcom"]["train"]["checkpoint"]
    rc, summary, out = local_run(
        work, "--dag", "ftrec_retrain", *PLAIN, *sets("params.seed=11"), "--conf", json.dumps({"train_overrides": LR0})
    )
    assert rc == 0 and summary, out[-4000:]
    base = summary["xcom"]["base_model"]
    assert (base["version"], base["alias"], base["checkpoint"]) == (1, "champion", champion_ckpt)
    run = _client(work).get_run(summary["xcom"]["train"]["mlflow_run_id"])
    assert run.data.params["train.init_checkpoint"] == champion_ckpt
    reg, tags = _gate(summary, work)
    assert reg["version"] == 3 and reg["champion"] == 1
    assert model_events(work)[-1]["dag"] == "ftrec_retrain" and model_events(work)[-1]["version"] == 3
    fp = summary["xcom"][SEAL]["fingerprint"]
    assert tags["gate.split_fingerprint"] == fp and f"gate: split fingerprint {fp}" in out
    assert fp != first[0]["xcom"][SEAL]["fingerprint"]  # shifted data: another split
    ev = summary["xcom"]["evaluate"]
    assert ev["champion"]["version"] == int(tags["gate.champion_version"]) and ev["champion"]["error"] is None
    won = reg["scores"]["challenger"][FULL] - reg["scores"]["champion"][FULL] >= GATE_MIN_MARGIN
    assert won is False and reg["promoted"] is False and tags["gate.verdict"] == "kept champion"
    assert reg["aliases"] == ["challenger"]


def test_no_champion_means_training_from_scratch(work, monkeypatch):
    from ftrec_airflow import tasks

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{work / 'mlflow' / 'mlflow.db'}")
    monkeypatch.delenv("AIRFLOW_CONN_FTREC_MLFLOW", raising=False)
    assert tasks.base_model(params={"model_name": "no-such-model"}) == {}
