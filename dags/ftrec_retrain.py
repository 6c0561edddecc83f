"""ftrec_retrain: refresh the shards from the newest interaction data and continue training from
the registry's champion (`models:/<model_name>@champion`; from scratch when there is none);
daily, and whenever new interaction data is announced on the `ftrec_interactions` Asset.

The long form: docs/airflow.md, "dags/ftrec_retrain"."""

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
