"""ftrec_airflow: the reusable Airflow glue between the DAGs and the ftrec packages.

The long form: docs/airflow.md, "plugins/ftrec_airflow"."""
