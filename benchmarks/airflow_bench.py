"""What Airflow costs ftrec, side by side in one run, as ratios.

    .venv/bin/python benchmarks/airflow_bench.py [--repeats 5] [--skip-pipeline]

1. Parsing: the dags folder (the ftrec DAGs) against a folder with one minimal TaskFlow
   DAG, each parsed by DagBag in a fresh interpreter (as the DAG processor does), median
   of `--repeats`; plus the heavy modules parsing imported (must be none).
2. Orchestration: the same small pipeline (generated data, 2 replica groups, a few steps)
   run directly (the step functions in one process, the launcher and eval as
   subprocesses) and through Airflow (`dag.test()` via local_run, which adds the metadata
   DB, task bookkeeping, XCom and MLflow bookkeeping).

Prints a table and writes bench-results/airflow.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ftcore.util.files import atomic_write_json
from ftrec_airflow import settings

HEAVY = ("torch", "mlflow", "pyarrow", "numpy", "pandas", "dataprep", "training", "ftcore")
MINIMAL_DAG = """
from datetime import datetime
from airflow.sdk import dag, task

@dag(dag_id="minimal", schedule=None, start_date=datetime(2026, 1, 1))
def minimal():
    @task
    def one() -> int:
        return 1
    one()

minimal()
"""
PARSE = r"""
import json, sys, time
from airflow.dag_processing.dagbag import DagBag
before = set(sys.modules)
t = time.perf_counter()
bag = DagBag(dag_folder=sys.argv[1])
dt = time.perf_counter() - t
heavy = sorted({m.split(".")[0] for m in set(sys.modules) - before} & set(json.loads(sys.argv[2])))
print("JSON" + json.dumps({"s": dt, "dags": len(bag.dags), "errors": len(bag.import_errors), "heavy": heavy}))
"""
SMALL: dict[str, Any] = {
    "data_source": "synthetic",
    "synth_users": 300,
    "synth_items": 150,
    "max_steps": 10,
    "batch_size": 16,
    "max_len": 20,
    "replica_groups": 2,
    "train_overrides": ["model.dim=16", "eval.batch_size=256"],
}


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def parse_once(folder: Path, home: Path) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", PARSE, str(folder), json.dumps(HEAVY)],
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in r.stdout.splitlines() if x.startswith("JSON")), None)
    if line is None:
        raise SystemExit(f"error: parsing {folder} failed:\n{r.stderr[-2000:]}")
    return json.loads(line[4:])


def bench_parse(repeats: int, tmp: Path) -> dict:
    minimal = tmp / "minimal_dags"
    minimal.mkdir()
    (minimal / "minimal.py").write_text(MINIMAL_DAG)
    ours, base = [], []
    for _ in range(repeats):  # interleaved: both see the same machine load
        base.append(parse_once(minimal, tmp / "home"))
        ours.append(parse_once(settings.PROJECT_ROOT / "dags", tmp / "home"))
    return {
        "ftrec_s": statistics.median(r["s"] for r in ours),
        "minimal_s": statistics.median(r["s"] for r in base),
        "ftrec_dags": ours[0]["dags"],
        "errors": ours[0]["errors"],
        "heavy": ours[0]["heavy"],
        "runs": {"ftrec": ours, "minimal": base},
    }


def run_direct(work: Path) -> float:
    """The pipeline without Airflow: the same step functions, launcher and evaluation."""
    from ftrec_airflow import mlflow_registry, pipeline_ops

    os.environ["FTREC_WORK"] = str(work)
    t = time.perf_counter()
    run_dir = work / "runs" / "direct"
    data = pipeline_ops.ingest(
        "synthetic", "sasrec", run_dir, synth_users=SMALL["synth_users"], synth_items=SMALL["synth_items"]
    )
    shards = pipeline_ops.build_shards(
        pipeline_ops.ShardSpec(
            input=data["path"],
            fmt=data["format"],
            out=str(run_dir / "shards"),
            world_size=2,
            batch_size=SMALL["batch_size"],
            max_len=SMALL["max_len"],
        )
    )
    pipeline_ops.check_shards(shards["path"])
    uri = settings.tracking_uri()
    (work / "mlflow").mkdir(parents=True, exist_ok=True)
    _, run_id = mlflow_registry.ensure_run("ftrec", "direct", tracking_uri=uri)
    spec = pipeline_ops.TrainSpec(
        shards=shards["path"],
        out=str(run_dir / "train"),
        replica_groups=2,
        max_steps=SMALL["max_steps"],
        overrides=SMALL["train_overrides"],
    )
    result = pipeline_ops.run_training(spec, run_id, uri)
    metrics = pipeline_ops.judge(result["checkpoint"], shards["path"], str(run_dir / "eval.json"))["metrics"]
    # as the evaluate task does: only what the trainer did not log already
    mlflow_registry.log_metrics(
        run_id, {mlflow_registry.metric_key(k): v for k, v in metrics.items()}, tracking_uri=uri
    )
    return time.perf_counter() - t


def run_airflow(work: Path) -> float:
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "ftrec_airflow.local_run", "--work", str(work), "--conf", json.dumps(SMALL)],
        env=_env(work / "airflow"),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if r.returncode != 0:
        raise SystemExit(f"error: the DAG run failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/airflow_bench.py", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-pipeline", action="store_true", help="only the parsing comparison")
    p.add_argument("--out", default=str(settings.PROJECT_ROOT / "bench-results" / "airflow.json"))
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ftrec-airflow-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        res: dict[str, Any] = {"parse": bench_parse(a.repeats, tmp), "load_avg": os.getloadavg()}
        if not a.skip_pipeline:
            res["pipeline"] = {"direct_s": run_direct(tmp / "direct"), "airflow_s": run_airflow(tmp / "airflow")}
    pr = res["parse"]
    print(f"{'measure':44s} {'ftrec':>9s} {'baseline':>9s} {'ratio':>7s}")
    print(
        f"{f'parse dags folder (s, median of {a.repeats})':44s} {pr['ftrec_s']:9.3f} {pr['minimal_s']:9.3f} "
        f"{pr['ftrec_s'] / pr['minimal_s']:7.2f}   ({pr['ftrec_dags']} DAGs vs 1 minimal DAG)"
    )
    print(f"{'heavy modules imported while parsing':44s} {len(pr['heavy']):9d} {'-':>9s} {'-':>7s}   {pr['heavy']}")
    if "pipeline" in res:
        pl = res["pipeline"]
        print(
            f"{'pipeline wall time (s): Airflow vs direct':44s} {pl['airflow_s']:9.1f} {pl['direct_s']:9.1f} "
            f"{pl['airflow_s'] / pl['direct_s']:7.2f}"
        )
    print(f"load average (1/5/15 min) at the end: {res['load_avg']}")
    out = Path(a.out)
    atomic_write_json(out, res, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
