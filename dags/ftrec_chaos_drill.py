"""ftrec_chaos_drill: a short fault-tolerant training under a fault plan (by default: kill
replica group 1, later kill the lighthouse), which fails unless

The long form: docs/airflow.md, "dags/ftrec_chaos_drill"."""

import json
from datetime import timedelta

from airflow.sdk import Param, dag, task

from ftrec_airflow import chaos, pipeline, tasks

PARAMS = {
    **pipeline.params(
        data_source="synthetic",
        synth_users=1000,
        synth_items=500,
        batch_size=16,
        replica_groups=2,
        max_steps=80,
        fault_plan=json.dumps(chaos.DEFAULT_PLAN),
        mlflow_experiment="ftrec-chaos",
    ),
    "max_stall_s": Param(30.0, type="number", minimum=0, description="Longest a survivor may go between two commits."),
}
DRILL = pipeline.TrainingDag("ftrec_chaos_drill", drill=True)  # no retries, no asset events


@dag(**DRILL.dag_args(__doc__, params=PARAMS, tags=("chaos",), max_active_runs=1))
def ftrec_chaos_drill():
    task(tasks.check_recovery)(DRILL.train(DRILL.shards(), timeout=timedelta(minutes=30)))


ftrec_chaos_drill()
