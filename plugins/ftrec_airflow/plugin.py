"""The ftrec Airflow plugin: the lighthouse status page inside the Airflow UI.

- a FastAPI app on the API server at /ftrec (ftrec_airflow.lighthouse_app);
- a "Lighthouse" tab on every DAG run page and a "ftcore lighthouse" entry in the
  Browse menu (external views: iframes of that app);
- the operators' links (MLflow run, lighthouse) are defined on the operators in
  ftrec_airflow.decorators, so they need no registration here.

Airflow finds it through the `airflow.plugins` entry point of the ftrec distribution
(pyproject.toml), so installing ftrec is all a deployment does; or, ftrec not installed,
through plugins/ftrec_plugin.py when the checkout's `plugins/` is Airflow's plugins folder.
With both, that file defers to the entry point: the plugin is registered once.
"""

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
