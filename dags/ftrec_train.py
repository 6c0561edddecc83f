"""ftrec_train: interaction data -> length-balanced shards -> fault-tolerant training ->
evaluation -> MLflow model registry, behind a quality gate.

The long form: docs/airflow.md, "dags/ftrec_train"."""

from datetime import timedelta

from airflow.sdk import dag

from ftrec_airflow import pipeline

TRAIN = pipeline.TrainingDag("ftrec_train")


@dag(**TRAIN.dag_args(__doc__, max_active_runs=4))
def ftrec_train():
    trained = TRAIN.train(TRAIN.shards(), timeout=timedelta(hours=24))
    TRAIN.gate(trained)


ftrec_train()
