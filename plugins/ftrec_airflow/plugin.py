"""The ftrec Airflow plugin: the lighthouse status page inside the Airflow UI.

The long form: docs/airflow.md, "plugins/ftrec_airflow/plugin"."""

from airflow.plugins_manager import AirflowPlugin

from ftrec_airflow.lighthouse_app import app


class FtrecPlugin(AirflowPlugin):
    name = "ftrec"
    fastapi_apps = [{"app": app, "url_prefix": "/ftrec", "name": "ftrec lighthouse"}]
    external_views = [
        {
            "name": "Lighthouse",
            "href": "/ftrec/lighthouse/?dag_id={DAG_ID}&run_id={RUN_ID}",
            "destination": "dag_run",
            "url_route": "ftrec-lighthouse-run",
        },
        {
            "name": "ftcore lighthouse",
            "href": "/ftrec/lighthouse/",
            "destination": "nav",
            "category": "browse",
            "url_route": "ftrec-lighthouse",
        },
    ]
