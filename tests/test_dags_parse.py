"""The dags folder as Airflow's DAG processor sees it: it imports with no errors, builds
the four DAGs with the expected tasks, wiring, params and defaults, serializes them as the
DAG processor stores them, and parsing imports nothing heavy (no torch, mlflow, pyarrow,
numpy, pandas, none of our packages that pull them in, and no Kubernetes client unless the
Kubernetes path is configured). ftrec_train_k8s parses with the cncf.kubernetes provider,
without it (its import blocked), and unconfigured, and says why it cannot run. Parsed in a
fresh interpreter, as the DAG processor does."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = (
    "torch",
    "mlflow",
    "pyarrow",
    "numpy",
    "pandas",
    "dataprep",
    "training",
    "ftcore",
    "sklearn",
    "scipy",
    "kubernetes",
    "airflow.providers.cncf.kubernetes",
)
K8S_PROVIDER = "airflow.providers.cncf.kubernetes"
# A sitecustomize that uninstalls the provider as far as the parsing interpreter can tell:
# its modules and the kubernetes clients it brings do not import, and their distributions'
# metadata is not found (Airflow's providers manager reads every installed provider's)
HIDDEN = ("apache-airflow-providers-cncf-kubernetes", "kubernetes", "kubernetes-asyncio")
BLOCK_PROVIDER = f"""
import sys
HIDDEN = {HIDDEN!r}
class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("kubernetes", "kubernetes_asyncio") or name == {K8S_PROVIDER!r} \\
                or name.startswith({K8S_PROVIDER!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
sys.meta_path.insert(0, _NotInstalled())

def _hide(metadata):
    discover = metadata.Distribution.discover.__func__
    def visible(cls, **kw):
        return (d for d in discover(cls, **kw)
                if (d.metadata["Name"] or "").lower().replace("_", "-") not in HIDDEN)
    metadata.Distribution.discover = classmethod(visible)
import importlib.metadata
_hide(importlib.metadata)
try:
    import importlib_metadata
    _hide(importlib_metadata)
except ImportError:
    pass
"""

PARSE = r"""
import json, sys
from airflow.dag_processing.dagbag import DagBag
from airflow.serialization.serialized_objects import DagSerialization
before = set(sys.modules)
bag = DagBag(dag_folder=sys.argv[1])
heavy = json.loads(sys.argv[2])
new = sorted(m for m in set(sys.modules) - before if any(m == h or m.startswith(h + ".") for h in heavy))
out = {"errors": {k: str(v) for k, v in bag.import_errors.items()}, "heavy": new, "dags": {}, "serialize": {}}
for dag_id, dag in bag.dags.items():
    try:
        DagSerialization.to_dict(dag)   # what the DAG processor stores for the scheduler and UI
    except Exception as e:
        out["serialize"][dag_id] = repr(e)
    out["dags"][dag_id] = {
        "schedule": str(dag.timetable), "tags": sorted(dag.tags), "doc": bool(dag.doc_md),
        "doc_md": dag.doc_md, "description": dag.description,
        "params": {k: {"value": p.value, "schema": p.schema, "description": p.description}
                   for k, p in dag.params.items()},
        "tasks": {t.task_id: {"type": type(t).__name__, "downstream": sorted(t.downstream_task_ids),
                              "operator": getattr(getattr(t, "operator_class", type(t)), "__name__", ""),
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
K8S_ENV = ("FTREC_K8S_IMAGE", "FTREC_K8S_NAMESPACE", "FTREC_K8S_GPU_RESOURCE", "FTREC_K8S_POD_TEMPLATE")
DAGS = ["ftrec_chaos_drill", "ftrec_retrain", "ftrec_train", "ftrec_train_k8s"]


def parse(home: Path, **extra_env: str) -> dict:
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(home / "plugins"),
    }  # empty: the plugin is an entry point
    for k in ("MLFLOW_TRACKING_URI", "FTREC_LIGHTHOUSE_URL", *TRAIN_ENV, *K8S_ENV):
        env.pop(k, None)
    env.update(extra_env)
    r = subprocess.run(
        [sys.executable, "-c", PARSE, str(ROOT / "dags"), json.dumps(HEAVY)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = next((out for out in r.stdout.splitlines() if out.startswith("JSON")), None)
    assert line, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(line[4:])


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    return parse(tmp_path_factory.mktemp("airflow-home"))


def test_dags_folder_imports_without_errors(parsed):
    assert parsed["errors"] == {} and parsed["serialize"] == {}
    assert sorted(parsed["dags"]) == DAGS


def test_parsing_imports_nothing_heavy(parsed):
    assert parsed["heavy"] == []


def test_ftrec_train_structure(parsed):
    d = parsed["dags"]["ftrec_train"]
    t = d["tasks"]
    assert {k: v["downstream"] for k, v in t.items()} == {
        "ingest_validate": ["build_shards.plan", "build_shards.prepare", "build_shards.seal"],
        **SHARD_GROUP,
        "verify_shards": ["train"],
        "train": ["evaluate", "register_model"],
        "evaluate": ["register_model"],
        "register_model": ["approve_champion", "promote_champion"],
        "approve_champion": ["promote_champion"],  # a person's Approve, where param champion_approval asks
        "promote_champion": [],
    }
    _assert_fanned_out(t, "ftrec_train_shards")
    assert t["register_model"]["outlets"] == ["ftrec_model"]
    assert t["approve_champion"]["type"] == "ChampionApproval"
    assert t["train"]["type"] == "FaultTolerantTrainOperator"
    assert (t["train"]["queue"], t["train"]["pool"]) == ("default", "default_pool")  # nothing configured
    assert t["train"]["links"] == ["Lighthouse", "MLflow run"]
    assert t["train"]["timeout"] == 24 * 3600
    for name in ("build_shards.bucket", "build_shards.seal", "train", "evaluate", "register_model"):
        assert t[name]["retries"] == 2 and t[name]["backoff"], name
    assert t["verify_shards"]["retries"] == 0  # a corrupt shard set does not heal by retrying
    assert t["ingest_validate"]["retries"] == 1 and not t["ingest_validate"]["backoff"]
    assert d["schedule"].startswith("NullTimetable") or "None" in d["schedule"] or "Null" in d["schedule"]
    assert d["doc"] and "ftrec" in d["tags"]


# build_shards: a task group of mapped tasks (shard_tasks.fanout), each dataprep.bucketed stage a task
SHARD_GROUP = {
    "build_shards.prepare": [
        "build_shards.ids",
        "build_shards.partition",
        "build_shards.plan",
        "build_shards.read",
        "build_shards.seal",
    ],
    "build_shards.read": ["build_shards.ids"],
    "build_shards.ids": ["build_shards.bucket", "build_shards.partition", "build_shards.route"],
    "build_shards.partition": ["build_shards.bucket"],
    "build_shards.bucket": ["build_shards.plan"],
    "build_shards.plan": ["build_shards.route", "build_shards.write"],
    "build_shards.route": ["build_shards.write"],
    "build_shards.write": ["build_shards.seal"],
    "build_shards.seal": ["verify_shards"],
}
MAPPED = ("read", "partition", "bucket", "route", "write")  # over input files, buckets, ranks


def _assert_fanned_out(t: dict, asset: str | None) -> None:
    assert not [k for k in t if k == "build_shards"]  # no single-task build
    for name in MAPPED:
        assert t[f"build_shards.{name}"]["type"].endswith("MappedOperator"), name
    assert t["build_shards.seal"]["outlets"] == ([asset] if asset else [])
    assert all(v["outlets"] == [] for k, v in t.items() if k.startswith("build_shards.") and k != "build_shards.seal")


def test_ftrec_train_params_have_types_descriptions_and_defaults(parsed):
    p = parsed["dags"]["ftrec_train"]["params"]
    want = {
        "data_source",
        "data_format",
        "split",
        "split_cut",
        "split_horizon",
        "synth_users",
        "synth_items",
        "max_len",
        "batch_size",
        "replica_groups",
        "ranks_per_group",
        "world_size",
        "shard_buckets",
        "shard_memory_budget",
        "epochs",
        "max_steps",
        "fault_plan",
        "mlflow_experiment",
        "model_name",
        "gate_metric",
        "gate_min",
        "gate_min_margin",
        "champion_approval",
        "champion_approval_hours",
        "train_overrides",
        "seed",
    }
    assert set(p) == want
    for name, param in p.items():
        assert param["schema"].get("type"), name
        assert param["description"] and len(param["description"]) > 15, name
    assert p["data_source"]["value"] == "auto"
    assert p["data_format"]["schema"]["enum"] == ["iclrec", "sasrec", "movielens", "events"]
    assert p["split"]["value"] == "auto" and p["split"]["schema"]["enum"] == ["auto", "leave_one_out", "temporal"]
    assert p["split_cut"]["value"] is None and p["split_horizon"]["schema"]["minimum"] == 1
    assert p["max_len"]["value"] == 50 and p["ranks_per_group"]["value"] == 1
    assert p["replica_groups"]["value"] == 2  # training always goes through the ftcore launcher
    assert p["world_size"]["schema"]["type"] == ["null", "integer"] and p["world_size"]["value"] is None
    assert p["fault_plan"]["value"] == ""
    assert p["shard_buckets"]["value"] is None and p["shard_memory_budget"]["value"] == ""
    assert p["mlflow_experiment"]["value"] == "ftrec" and p["model_name"]["value"] == "ftrec"
    assert p["gate_metric"]["value"] == "test/full/ndcg_at_10" and p["gate_min"]["schema"]["type"] == "number"
    assert p["gate_min_margin"]["value"] > 0 and p["gate_min_margin"]["schema"]["minimum"] == 0
    assert p["champion_approval"]["value"] is False and p["champion_approval_hours"]["schema"]["exclusiveMinimum"] == 0


def test_ftrec_retrain_runs_daily_or_on_new_data(parsed):
    d = parsed["dags"]["ftrec_retrain"]
    assert "AssetOrTimeSchedule" in d["schedule"] and "ftrec_interactions" in d["schedule"]
    assert "0 3 * * *" in d["schedule"]
    t = d["tasks"]
    assert t["base_model"]["downstream"] == ["train"] and t["verify_shards"]["downstream"] == ["train"]
    assert t["train"]["downstream"] == ["evaluate", "register_model"]
    _assert_fanned_out(t, "ftrec_retrain_shards")
    assert t["register_model"]["outlets"] == ["ftrec_model"]


def test_ftrec_chaos_drill_defaults_to_a_fault_plan(parsed):
    d = parsed["dags"]["ftrec_chaos_drill"]
    plan = json.loads(d["params"]["fault_plan"]["value"])
    assert {f["kind"] for f in plan["faults"]} == {"kill", "kill_lighthouse"}
    assert d["params"]["replica_groups"]["value"] == 2 and d["params"]["max_stall_s"]["value"] > 0
    t = d["tasks"]
    assert t["train"]["downstream"] == ["check_recovery"] and t["train"]["retries"] == 0
    assert all(v["retries"] == 0 for v in t.values())  # a drill that needs a second try has failed
    assert all(v["outlets"] == [] for v in t.values())  # and its shards are nobody's input
    assert t["train"]["links"] == ["Lighthouse", "MLflow run"]
    _assert_fanned_out(t, None)


def test_train_tasks_run_where_the_deployment_says(tmp_path):
    """FTREC_TRAIN_* (or [ftrec] train_* in airflow.cfg) at parse time: the train task of
    every DAG gets the queue, pool, priority and executor config; no other task does."""
    parsed = parse(
        tmp_path,
        FTREC_TRAIN_QUEUE="gpu",
        FTREC_TRAIN_POOL="trainers",
        FTREC_TRAIN_PRIORITY_WEIGHT="7",
        FTREC_TRAIN_EXECUTOR_CONFIG='{"gpus": 2}',
    )
    assert parsed["errors"] == {}
    assert parsed["errors"] == {}
    for dag_id in ("ftrec_chaos_drill", "ftrec_retrain", "ftrec_train"):
        t = parsed["dags"][dag_id]["tasks"]
        got = {k: t["train"][k] for k in ("queue", "pool", "priority_weight", "executor_config")}
        assert got == {"queue": "gpu", "pool": "trainers", "priority_weight": 7, "executor_config": {"gpus": 2}}, dag_id
        assert all((v["queue"], v["pool"]) == ("default", "default_pool") for k, v in t.items() if k != "train")


# ---------------------------------------------------------------- ftrec_train_k8s


def _unavailable(d: dict) -> str:
    assert list(d["tasks"]) == ["kubernetes_unavailable"], d["tasks"]
    assert d["description"].startswith("unavailable: ") and "Not available here" in d["doc_md"]
    return d["description"]


def test_ftrec_train_k8s_unconfigured_says_what_to_set(parsed):
    """The default: no image configured. The DAG is there, says what to set, and its file
    imported neither the provider nor the kubernetes client (test_parsing_imports_nothing_heavy)."""
    why = _unavailable(parsed["dags"]["ftrec_train_k8s"])
    assert "FTREC_K8S_IMAGE" in why


def test_ftrec_train_k8s_with_the_provider_is_the_training_pipeline_on_pods(tmp_path):
    pytest.importorskip(K8S_PROVIDER, reason="pip install -e '.[kubernetes]' (make setup does)")
    parsed = parse(tmp_path, FTREC_K8S_IMAGE="registry.example/ftrec:0.1.0", FTREC_K8S_NAMESPACE="recs")
    assert parsed["errors"] == {} and parsed["serialize"] == {} and sorted(parsed["dags"]) == DAGS
    d = parsed["dags"]["ftrec_train_k8s"]
    t = d["tasks"]
    assert {k: v["downstream"] for k, v in t.items()} == {
        "ingest_validate": [
            "build_shards.calibrate_args",
            "build_shards.plan",
            "build_shards.prepare",
            "build_shards.seal",
        ],
        # the cost model is timed on the training pool (a one-GPU pod) before the build reads it
        "build_shards.calibrate_args": ["build_shards.calibrate"],
        "build_shards.calibrate": ["build_shards.prepare"],
        **SHARD_GROUP,
        "verify_shards": ["open_run"],
        "open_run": ["drop_job_token", "group_pods", "job_token", "trained"],
        "job_token": ["train_group"],  # the pods mount their job's token Secret: it exists first
        "group_pods": ["train_group"],
        "train_group": ["drop_job_token", "trained"],
        "drop_job_token": [],
        "trained": ["evaluate", "register_model"],
        "evaluate": ["register_model"],
        "register_model": ["approve_champion", "promote_champion"],
        "approve_champion": ["promote_champion"],  # a person's Approve, where param champion_approval asks
        "promote_champion": [],
    }
    # one mapped task, map index = replica group: a retry is one group's pod again
    assert t["train_group"]["type"] == "MappedOperator" and t["train_group"]["operator"] == "GroupPodOperator"
    assert t["train_group"]["retries"] == 2 and t["train_group"]["timeout"] == 24 * 3600
    assert t["register_model"]["outlets"] == ["ftrec_model"]
    assert t["build_shards.calibrate"]["operator"] == "GroupPodOperator"
    _assert_fanned_out(t, "ftrec_train_k8s_shards")
    # each mapped stage a pod (python -m dataprep stage ...), retried alone like a task
    for name in MAPPED:
        assert t[f"build_shards.{name}"]["operator"] == "GroupPodOperator", name
        assert t[f"build_shards.{name}"]["retries"] == 2, name
    assert "kubernetes" in d["tags"] and d["description"] == "replica groups as Kubernetes pods"
    assert set(d["params"]) == set(parsed["dags"]["ftrec_train"]["params"])


def test_ftrec_train_k8s_without_the_provider_parses_and_says_why(tmp_path):
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(BLOCK_PROVIDER)
    parsed = parse(tmp_path / "home", FTREC_K8S_IMAGE="registry.example/ftrec:0.1.0", PYTHONPATH=str(block))
    assert parsed["errors"] == {} and parsed["serialize"] == {} and sorted(parsed["dags"]) == DAGS
    why = _unavailable(parsed["dags"]["ftrec_train_k8s"])
    assert "blocked by the test" in why and "pip install 'ftrec[kubernetes]'" in why
    assert not [m for m in parsed["heavy"] if m.startswith(("kubernetes", K8S_PROVIDER))]
