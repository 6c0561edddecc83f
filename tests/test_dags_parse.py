"""The dags folder as Airflow's DAG processor sees it: it imports with no errors, builds
the three DAGs with the expected tasks, wiring, params and defaults, and parsing imports
nothing heavy (no torch, mlflow, pyarrow, numpy, pandas, and none of our packages that
pull them in). Parsed in a fresh interpreter, as the DAG processor does."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "mlflow", "pyarrow", "numpy", "pandas", "dataprep", "training", "ftcore", "sklearn", "scipy")

PARSE = r"""
import json, sys
from airflow.dag_processing.dagbag import DagBag
before = set(sys.modules)
bag = DagBag(dag_folder=sys.argv[1])
new = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in json.loads(sys.argv[2]))
out = {"errors": {k: str(v) for k, v in bag.import_errors.items()}, "heavy": new, "dags": {}}
for dag_id, dag in bag.dags.items():
    out["dags"][dag_id] = {
        "schedule": str(dag.timetable), "tags": sorted(dag.tags), "doc": bool(dag.doc_md),
        "params": {k: {"value": p.value, "schema": p.schema, "description": p.description}
                   for k, p in dag.params.items()},
        "tasks": {t.task_id: {"type": type(t).__name__, "downstream": sorted(t.downstream_task_ids),
                              "retries": t.retries, "backoff": bool(t.retry_exponential_backoff),
                              "outlets": [getattr(o, "name", str(o)) for o in t.outlets],
                              "queue": t.queue, "pool": t.pool, "priority_weight": t.priority_weight,
                              "executor_config": t.executor_config,
                              "links": sorted(l.name for l in t.operator_extra_links),
                              "timeout": t.execution_timeout.total_seconds() if t.execution_timeout else None}
                  for t in dag.tasks},
    }
print("JSON" + json.dumps(out, default=str))
"""


TRAIN_ENV = ("FTREC_TRAIN_QUEUE", "FTREC_TRAIN_POOL", "FTREC_TRAIN_PRIORITY_WEIGHT", "FTREC_TRAIN_EXECUTOR_CONFIG")


def parse(home: Path, **extra_env: str) -> dict:
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
           "AIRFLOW__CORE__PLUGINS_FOLDER": str(home / "plugins")}  # empty: the plugin is an entry point
    for k in ("MLFLOW_TRACKING_URI", *TRAIN_ENV):
        env.pop(k, None)
    env.update(extra_env)
    r = subprocess.run([sys.executable, "-c", PARSE, str(ROOT / "dags"), json.dumps(HEAVY)],
                       env=env, capture_output=True, text=True, timeout=120)
    line = next((l for l in r.stdout.splitlines() if l.startswith("JSON")), None)
    assert line, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(line[4:])


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    return parse(tmp_path_factory.mktemp("airflow-home"))


def test_dags_folder_imports_without_errors(parsed):
    assert parsed["errors"] == {}
    assert sorted(parsed["dags"]) == ["ftrec_chaos_drill", "ftrec_retrain", "ftrec_train"]


def test_parsing_imports_nothing_heavy(parsed):
    assert parsed["heavy"] == []


def test_ftrec_train_structure(parsed):
    d = parsed["dags"]["ftrec_train"]
    t = d["tasks"]
    assert {k: v["downstream"] for k, v in t.items()} == {
        "ingest_validate": ["build_shards"], "build_shards": ["verify_shards"], "verify_shards": ["train"],
        "train": ["evaluate", "register_model"], "evaluate": ["register_model"], "register_model": []}
    assert t["build_shards"]["type"] == "BuildShardsOperator"
    assert t["build_shards"]["outlets"] == ["ftrec_train_shards"]
    assert t["register_model"]["outlets"] == ["ftrec_model"]
    assert t["train"]["type"] == "FaultTolerantTrainOperator"
    assert (t["train"]["queue"], t["train"]["pool"]) == ("default", "default_pool")  # nothing configured
    assert t["train"]["links"] == ["Lighthouse", "MLflow run"]
    assert t["train"]["timeout"] == 24 * 3600
    for name in ("build_shards", "train", "evaluate", "register_model"):
        assert t[name]["retries"] == 2 and t[name]["backoff"], name
    assert t["verify_shards"]["retries"] == 0  # a corrupt shard set does not heal by retrying
    assert d["schedule"].startswith("NullTimetable") or "None" in d["schedule"] or "Null" in d["schedule"]
    assert d["doc"] and "ftrec" in d["tags"]


def test_ftrec_train_params_have_types_descriptions_and_defaults(parsed):
    p = parsed["dags"]["ftrec_train"]["params"]
    want = {"data_source", "data_format", "synth_users", "synth_items", "max_len", "batch_size",
            "replica_groups", "ranks_per_group", "world_size", "epochs", "max_steps", "fault_plan",
            "mlflow_experiment", "model_name", "gate_metric", "gate_min", "promote_across_metrics",
            "train_overrides", "seed"}
    assert set(p) == want
    for name, param in p.items():
        assert param["schema"].get("type"), name
        assert param["description"] and len(param["description"]) > 15, name
    assert p["data_source"]["value"] == "auto"
    assert p["data_format"]["schema"]["enum"] == ["iclrec", "sasrec", "movielens", "events"]
    assert p["max_len"]["value"] == 50 and p["ranks_per_group"]["value"] == 1
    assert p["replica_groups"]["value"] in (1, 2)
    assert p["world_size"]["schema"]["type"] == ["null", "integer"] and p["world_size"]["value"] is None
    assert p["fault_plan"]["value"] == ""
    assert p["mlflow_experiment"]["value"] == "ftrec" and p["model_name"]["value"] == "ftrec"
    assert p["gate_metric"]["value"] == "test/sampled/ndcg_at_10" and p["gate_min"]["schema"]["type"] == "number"
    assert p["promote_across_metrics"]["value"] is False


def test_ftrec_retrain_runs_daily_or_on_new_data(parsed):
    d = parsed["dags"]["ftrec_retrain"]
    assert "AssetOrTimeSchedule" in d["schedule"] and "ftrec_interactions" in d["schedule"]
    assert "0 3 * * *" in d["schedule"]
    t = d["tasks"]
    assert t["base_model"]["downstream"] == ["train"] and t["verify_shards"]["downstream"] == ["train"]
    assert t["train"]["downstream"] == ["evaluate", "register_model"]
    assert t["build_shards"]["outlets"] == ["ftrec_retrain_shards"]
    assert t["register_model"]["outlets"] == ["ftrec_model"]


def test_ftrec_chaos_drill_defaults_to_a_fault_plan(parsed):
    d = parsed["dags"]["ftrec_chaos_drill"]
    plan = json.loads(d["params"]["fault_plan"]["value"])
    assert {f["kind"] for f in plan["faults"]} == {"kill", "kill_lighthouse"}
    assert d["params"]["replica_groups"]["value"] == 2 and d["params"]["max_stall_s"]["value"] > 0
    t = d["tasks"]
    assert t["train"]["downstream"] == ["check_recovery"] and t["train"]["retries"] == 0
    assert t["train"]["links"] == ["Lighthouse", "MLflow run"]


def test_train_tasks_run_where_the_deployment_says(tmp_path):
    """FTREC_TRAIN_* (or [ftrec] train_* in airflow.cfg) at parse time: the train task of
    every DAG gets the queue, pool, priority and executor config; no other task does."""
    parsed = parse(tmp_path, FTREC_TRAIN_QUEUE="gpu", FTREC_TRAIN_POOL="trainers",
                   FTREC_TRAIN_PRIORITY_WEIGHT="7", FTREC_TRAIN_EXECUTOR_CONFIG='{"gpus": 2}')
    assert parsed["errors"] == {}
    for dag_id, d in parsed["dags"].items():
        t = d["tasks"]
        got = {k: t["train"][k] for k in ("queue", "pool", "priority_weight", "executor_config")}
        assert got == {"queue": "gpu", "pool": "trainers", "priority_weight": 7, "executor_config": {"gpus": 2}}, dag_id
        assert all((v["queue"], v["pool"]) == ("default", "default_pool") for k, v in t.items() if k != "train")
