"""ftrec_train: interaction data -> length-balanced shards -> fault-tolerant training ->
evaluation -> MLflow model registry, behind a quality gate.

A version that passes the gate gets the alias `challenger`, and `champion` as well when
it beats the champion on the gate metric; each registration is an event on the
`ftrec_model` Asset.

Trigger it with params (data source and format, topology, fault plan, MLflow experiment,
gate). Every task writes under the DAG run's own folder and can be retried: a retry
reuses finished output and resumes the same MLflow run. The work is in the `ftrec_airflow`,
`dataprep` and `training` packages.
"""

from datetime import datetime, timedelta

from airflow.sdk import Asset, dag, task

from ftrec_airflow import pipeline, settings
from ftrec_airflow.decorators import build_shards_task, ft_train_task

SHARDS = Asset(name="ftrec_train_shards", uri="ftrec://shards/ftrec_train")
RETRY = {"retries": 2, "retry_delay": timedelta(seconds=10), "retry_exponential_backoff": 2.0}


@dag(dag_id="ftrec_train", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
     params=pipeline.params(), tags=["ftrec"], doc_md=__doc__, max_active_runs=4)
def ftrec_train():
    @task(retries=1, retry_delay=timedelta(seconds=5))
    def ingest_validate(params=None) -> dict:
        return pipeline.ingest_validate(params)

    @build_shards_task(outlets=[SHARDS], **RETRY)
    def build_shards(data: dict, params=None):
        return pipeline.shard_spec(params, data)

    @task
    def verify_shards(shards: dict) -> dict:
        return pipeline.verify_shards(shards)

    @ft_train_task(**RETRY, **settings.train_task_args(), execution_timeout=timedelta(hours=24))
    def train(shards: dict, params=None):
        return pipeline.train_spec(params, shards)

    @task(**RETRY)
    def evaluate(trained: dict) -> dict:
        return pipeline.evaluate(trained)

    @task(**RETRY, outlets=[pipeline.MODEL])
    def register_model(trained: dict, evaluation: dict, params=None) -> dict:
        return pipeline.register_model(params, trained, evaluation)

    shards = verify_shards(build_shards(ingest_validate()))
    trained = train(shards)
    register_model(trained, evaluate(trained))


ftrec_train()
