"""ftrec_retrain: refresh the shards from the newest interaction data and continue
training from the registry's champion (`models:/<model_name>@champion`; from scratch when
there is none); daily, and whenever new interaction data is announced on the
`ftrec_interactions` Asset.

A producer announces new data by emitting an event on the Asset with the file in its
extra, for example through the REST API:
`POST /api/v2/assets/events {"asset_id": ..., "extra": {"path": "/data/events.txt", "format": "sasrec"}}`,
or from a task with `outlets=[INTERACTIONS]`. Without an event (the daily run) the
`data_source` param is read again. The new model is registered behind the same quality gate
and becomes champion only if it beats the current champion, which is re-scored on the new
data's test split by the same evaluation (see ftrec_train): a score from an older test never counts.
"""

from datetime import timedelta

from airflow.sdk import Asset, AssetOrTimeSchedule, CronTriggerTimetable, dag, task

from ftrec_airflow import pipeline, tasks

INTERACTIONS = Asset(name="ftrec_interactions", uri="ftrec://interactions")
RETRAIN = pipeline.TrainingDag("ftrec_retrain")


@dag(
    **RETRAIN.dag_args(
        __doc__,
        max_active_runs=1,
        schedule=AssetOrTimeSchedule(timetable=CronTriggerTimetable("0 3 * * *", timezone="UTC"), assets=INTERACTIONS),
    )
)
def ftrec_retrain():
    shards = RETRAIN.shards(ingest=tasks.ingest_new_data)
    trained = RETRAIN.train(shards, task(tasks.base_model)(), timeout=timedelta(hours=24))
    RETRAIN.gate(trained)


ftrec_retrain()
