"""ftrec_airflow: the reusable Airflow glue between the DAGs and the ftrec packages.

`dags/` only wires tasks together; the work lives here and in `dataprep`/`training`:
`settings` (where things live), `runner` (subprocesses whose logs stream into the task
log and whose whole process group dies with the task), `pipeline_ops` (what each pipeline
task does, no Airflow inside), `mlflow_registry` (MLflow runs and the model registry),
`decorators` and `links` (reusable "build shards" and "fault-tolerant train" operators with
their MLflow and lighthouse links), `lighthouse_status` (the lighthouse's status as the train
task watches it), `lighthouse_app` (the lighthouse status page inside the Airflow UI), `plugin` (the
Airflow plugin, found through the `airflow.plugins` entry point), `kubernetes` (replica
groups as pods, for ftrec_train_k8s) and `local_run` (what `make run` calls).

Nothing here imports torch, mlflow or pyarrow at module level: the DAG processor
imports this package every time it parses a DAG file.
"""
