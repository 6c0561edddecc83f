"""Operator extra links: a task's MLflow run and the ftcore lighthouse status page.

Airflow 3 computes a task's links when the task finishes, in the task's own process, and
stores them in XCom for the UI; so a link reads what the operator recorded while it ran.
"""

from urllib.parse import urlencode

from airflow.sdk import BaseOperatorLink

LIGHTHOUSE_PAGE = "/ftrec/lighthouse/"  # served by the plugin's FastAPI app (lighthouse_app)


def _api_base() -> str:
    try:
        from airflow.sdk.configuration import conf

        return (conf.get("api", "base_url", fallback="") or "").rstrip("/")
    except Exception:
        return ""


def lighthouse_page(dag_id: str, run_id: str) -> str:
    return f"{_api_base()}{LIGHTHOUSE_PAGE}?{urlencode({'dag_id': dag_id, 'run_id': run_id})}"


class MLflowRunLink(BaseOperatorLink):
    """The MLflow run the task trained or evaluated (FTREC_MLFLOW_UI sets the UI's address)."""

    name = "MLflow run"

    def get_link(self, operator, *, ti_key) -> str:
        return getattr(operator, "mlflow_run_url", "") or ""


class LighthouseLink(BaseOperatorLink):
    """The lighthouse status of the task's training: live while it runs, the last
    snapshot afterwards."""

    name = "Lighthouse"

    def get_link(self, operator, *, ti_key) -> str:
        dag_id = getattr(ti_key, "dag_id", None)
        run_id = getattr(ti_key, "run_id", None)
        return lighthouse_page(dag_id, run_id) if dag_id and run_id else ""
