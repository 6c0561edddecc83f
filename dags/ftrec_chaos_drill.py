"""ftrec_chaos_drill: a short fault-tolerant training under a fault plan (by default: kill
replica group 1, later kill the lighthouse), which fails unless

- MLflow shows the recovery (ft/failures_detected, ft/quorum_changes, ft/heals and the
  timeline artifact on the training run),
- the surviving replica groups never stopped committing (no hole in their steps, no gap
  between commits longer than `max_stall_s`),
- every replica group ends with identical parameters and optimizer state.

Run it before trusting a new cluster, image or ftcore version. Fault plan format:
ftcore/faults.py.
"""

import json
from datetime import datetime, timedelta

from airflow.sdk import Param, dag, task

from ftrec_airflow import chaos, pipeline, settings
from ftrec_airflow.decorators import build_shards_task, ft_train_task

PARAMS = {
    **pipeline.params(data_source="synthetic", synth_users=1000, synth_items=500, batch_size=16,
                      replica_groups=2, max_steps=80, fault_plan=json.dumps(chaos.DEFAULT_PLAN),
                      mlflow_experiment="ftrec-chaos"),
    "max_stall_s": Param(30.0, type="number", minimum=0,
                         description="Longest a survivor may go between two commits."),
}


@dag(dag_id="ftrec_chaos_drill", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
     max_active_runs=1, params=PARAMS, tags=["ftrec", "chaos"], doc_md=__doc__)
def ftrec_chaos_drill():
    @task
    def ingest_validate(params=None) -> dict:
        return pipeline.ingest_validate(params)

    @build_shards_task
    def build_shards(data: dict, params=None):
        return pipeline.shard_spec(params, data)

    @task
    def verify_shards(shards: dict) -> dict:
        return pipeline.verify_shards(shards)

    # No retries: a drill that needs a second try has already failed.
    @ft_train_task(**settings.train_task_args(), execution_timeout=timedelta(minutes=30))
    def train(shards: dict, params=None):
        return pipeline.train_spec(params, shards)

    @task
    def check_recovery(trained: dict, params=None) -> dict:
        return pipeline.judge_drill(params, trained, float(params["max_stall_s"]))

    check_recovery(train(verify_shards(build_shards(ingest_validate()))))


ftrec_chaos_drill()
