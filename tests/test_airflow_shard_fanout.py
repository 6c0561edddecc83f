"""build_shards fanned out over Airflow tasks (ftrec_airflow.shard_tasks), by `dag.test()` of a
DAG made of the pipeline's own ingest -> build_shards group -> verify_shards: 2 input files
(2 read and 2 partition tasks), 4 buckets, 2 ranks (2 write tasks). The set is the one the
single-process build makes, byte for byte (the inputs carry event times: the split param's
"auto" is temporal); bucket 1's process is SIGKILLed on its first try with its output
half-written, and that task alone is retried and finishes the set.
"""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_python
from test_dataprep_bucketed import _assert_same

from dataprep.build import build_shards

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

DAG = '''"""ftrec_shards_fanout: build_shards as mapped tasks (test DAG)."""
import os
from datetime import timedelta

from airflow.sdk import dag

from ftrec_airflow import pipeline

FANOUT = pipeline.TrainingDag("ftrec_shards_fanout", shard_fanout={"buckets": 4})


def ingest(params=None):
    return {"path": os.environ["FANOUT_INPUTS"].split(","), "format": "events"}


@dag(**FANOUT.dag_args("build_shards fanned out", default_args={"retries": 1, "retry_delay": timedelta(seconds=1)}))
def ftrec_shards_fanout():
    FANOUT.shards(ingest)


ftrec_shards_fanout()
'''

CHILD = """
import json, os, sys
from airflow.dag_processing.dagbag import DagBag
from airflow.utils import db
db.upgradedb()
bag = DagBag(dag_folder=os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
assert not bag.import_errors, bag.import_errors
dr = bag.dags["ftrec_shards_fanout"].test(run_conf={"world_size": 2, "replica_groups": 2, "batch_size": 16})
tis = [
    {"task": ti.task_id, "map": ti.map_index, "state": str(ti.state), "try": ti.try_number}
    for ti in dr.get_task_instances()
]
shards = [ti for ti in dr.get_task_instances() if ti.task_id == "build_shards.seal"][0].xcom_pull()
print("RESULT " + json.dumps({"state": str(dr.state), "tis": tis, "shards": shards}))
"""


def _inputs(folder: Path) -> list[str]:
    rng = np.random.default_rng(4)
    out = []
    for k in range(2):
        n = 6000
        t = pa.table(
            {
                "user_id": rng.integers(0, 400, n) + 200 * k,
                "item_id": rng.integers(0, 300, n),
                "timestamp": 1_700_000_000 + rng.integers(0, 10**6, n),
            }
        )
        pq.write_table(t, folder / f"part-{k}.parquet", row_group_size=1500)
        out.append(str(folder / f"part-{k}.parquet"))
    return out


def test_fanned_out_build_matches_single_process_and_retries_one_bucket(tmp_path):
    from ftrec_airflow import local_run

    (tmp_path / "dags").mkdir()
    (tmp_path / "dags" / "ftrec_shards_fanout.py").write_text(DAG)
    inputs = _inputs(tmp_path)
    env = {
        **local_run.airflow_env(tmp_path / "work"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(tmp_path / "dags"),
        "FANOUT_INPUTS": ",".join(inputs),
        "FTREC_DATAPREP_KILL": "bucket/1",  # bucket 1's process SIGKILLs itself on its first try
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    r = run_python(["-c", CHILD], timeout=600, env={**env, "FTREC_WORK": str(tmp_path / "work")})
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stdout[-4000:]
    res = json.loads(line[-1][len("RESULT ") :])
    assert res["state"].endswith("success"), res
    by_task: dict[str, list[dict]] = {}
    for ti in res["tis"]:
        by_task.setdefault(ti["task"], []).append(ti)
    counts = {t: len(v) for t, v in by_task.items()}
    assert counts["build_shards.read"] == counts["build_shards.partition"] == 2
    assert counts["build_shards.bucket"] == counts["build_shards.route"] == 4
    assert counts["build_shards.write"] == 2 and counts["verify_shards"] == 1
    assert all(ti["state"].endswith("success") for ti in res["tis"])
    tries = {(ti["task"], ti["map"]): ti["try"] for ti in res["tis"]}
    assert tries[("build_shards.bucket", 1)] == 2  # killed once, retried alone
    assert [k for k, v in tries.items() if v != 1] == [("build_shards.bucket", 1)]
    out = Path(res["shards"]["path"])
    m = json.loads((out / "manifest.json").read_text())
    ref = tmp_path / "ref"
    cm = m["config"]["cost_model"]
    build_shards(inputs, "events", str(ref), world_size=2, batch_size=16, max_len=50, cost_model=cm, split="temporal")
    _assert_same(ref, out)
    assert m["split"]["kind"] == "temporal" and m["split"]["test_users"] > 0
    assert not list(out.parent.glob(f".{out.name}.stage-*"))  # the staging folder became the set
