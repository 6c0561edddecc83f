"""ftrec_retrain: refresh the shards from the newest interaction data and continue
training from the registry's champion (`models:/<model_name>@champion`; from scratch when
there is none); daily, and whenever new interaction data is announced on the
`ftrec_interactions` Asset.

A producer announces new data by emitting an event on the Asset with the file in its
extra, for example through the REST API:
`POST /api/v2/assets/events {"asset_id": ..., "extra": {"path": "/data/events.txt", "format": "sasrec"}}`,
or from a task with `outlets=[INTERACTIONS]`. Without an event (the daily run) the
`data_source` param is read again. The new model is registered behind the same quality gate
and becomes champion only if it beats the current champion (see ftrec_train).
"""

from datetime import datetime, timedelta

from airflow.sdk import Asset, AssetOrTimeSchedule, CronTriggerTimetable, dag, task

from ftrec_airflow import pipeline, settings
from ftrec_airflow.decorators import build_shards_task, ft_train_task

INTERACTIONS = Asset(name="ftrec_interactions", uri="ftrec://interactions")
SHARDS = Asset(name="ftrec_retrain_shards", uri="ftrec://shards/ftrec_retrain")
RETRY = {"retries": 2, "retry_delay": timedelta(seconds=10), "retry_exponential_backoff": 2.0}


@dag(dag_id="ftrec_retrain", start_date=datetime(2026, 1, 1), catchup=False, max_active_runs=1,
     schedule=AssetOrTimeSchedule(timetable=CronTriggerTimetable("0 3 * * *", timezone="UTC"),
                                  assets=INTERACTIONS),
     params=pipeline.params(), tags=["ftrec"], doc_md=__doc__)
def ftrec_retrain():
    @task(**RETRY)
    def base_model(params=None) -> dict:
        return pipeline.base_model(params)

    @task(retries=1, retry_delay=timedelta(seconds=5))
    def ingest_validate(params=None) -> dict:
        return pipeline.ingest_new_data(params)

    @build_shards_task(outlets=[SHARDS], **RETRY)
    def build_shards(data: dict, params=None):
        return pipeline.shard_spec(params, data)

    @task
    def verify_shards(shards: dict) -> dict:
        return pipeline.verify_shards(shards)

    @ft_train_task(**RETRY, **settings.train_task_args(), execution_timeout=timedelta(hours=24))
    def train(shards: dict, base: dict, params=None):
        return pipeline.train_spec(params, shards, base=base)

    @task(**RETRY)
    def evaluate(trained: dict) -> dict:
        return pipeline.evaluate(trained)

    @task(**RETRY, outlets=[pipeline.MODEL])
    def register_model(trained: dict, evaluation: dict, params=None) -> dict:
        return pipeline.register_model(params, trained, evaluation)

    trained = train(verify_shards(build_shards(ingest_validate())), base_model())
    register_model(trained, evaluate(trained))


ftrec_retrain()
