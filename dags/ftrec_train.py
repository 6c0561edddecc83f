"""ftrec_train: interaction data -> length-balanced shards -> fault-tolerant training ->
evaluation -> MLflow model registry, behind a quality gate.

A version that reaches gate_min gets the alias `challenger`, and `champion` as well when it
beats the champion by gate_min_margin, both scored by the same evaluation on this run's test
split (full ranking by default); each registration is an event on the `ftrec_model` Asset.

Trigger it with params (data source and format, topology, fault plan, MLflow experiment,
gate). Every task writes under the DAG run's own folder and can be retried: a retry
reuses finished output and resumes the same MLflow run. The work is in the `ftrec_airflow`,
`dataprep` and `training` packages.
"""

from datetime import timedelta

from airflow.sdk import dag

from ftrec_airflow import pipeline

TRAIN = pipeline.TrainingDag("ftrec_train")


@dag(**TRAIN.dag_args(__doc__, max_active_runs=4))
def ftrec_train():
    trained = TRAIN.train(TRAIN.shards(), timeout=timedelta(hours=24))
    TRAIN.gate(trained)


ftrec_train()
