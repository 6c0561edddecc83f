"""Where the pipeline keeps its files and talks to MLflow: embedded defaults, env overrides.

Embedded defaults put everything under one work folder in the project:

    work/airflow/               AIRFLOW_HOME (metadata in airflow.db, task logs)
    work/mlflow/mlflow.db       MLflow tracking store (SQLite)
    work/mlflow/artifacts/      MLflow artifacts
    work/runs/<dag>/<run>/      one folder per DAG run: data, shards, training output

Environment overrides (a real deployment sets these; nothing else reads globals):
FTREC_WORK (the work folder), MLFLOW_TRACKING_URI (a real MLflow server),
FTREC_MLFLOW_UI (the MLflow UI base URL for links), FTREC_LIGHTHOUSE_URL (a lighthouse
that is not started by the launcher), FTREC_SHARED_DATA (the folder holding beauty.txt).
"""

import os
import re
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]

DEFAULT_EXPERIMENT = "ftrec"
DEFAULT_MODEL_NAME = "ftrec"
DEFAULT_MLFLOW_UI = "http://127.0.0.1:5000"


def work_root() -> Path:
    return Path(os.environ.get("FTREC_WORK") or PROJECT_ROOT / "work").resolve()


def shared_data() -> Path:
    return Path(os.environ.get("FTREC_SHARED_DATA") or PROJECT_ROOT.parent / "shared" / "data")


def default_source() -> str:
    """The shared Beauty file when it is there, otherwise generated data."""
    beauty = shared_data() / "beauty.txt"
    return str(beauty) if beauty.exists() else "synthetic"


def tracking_uri() -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{work_root() / 'mlflow' / 'mlflow.db'}"


def artifact_root() -> str | None:
    """Artifact location for experiments we create: beside a local SQLite store; None lets
    a tracking server decide (its --default-artifact-root or proxied artifacts)."""
    uri = tracking_uri()
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri[len("sqlite:///"):]).parent / "artifacts").resolve().as_uri()


def mlflow_ui() -> str:
    return os.environ.get("FTREC_MLFLOW_UI", DEFAULT_MLFLOW_UI).rstrip("/")


def lighthouse_url() -> str:
    return os.environ.get("FTREC_LIGHTHOUSE_URL", "").rstrip("/")


def lighthouse_job_id(run_key: str) -> str:
    """The job id one training run reports under on a standing lighthouse (ftcore's JOB_ID
    syntax): the run key `dag/run/task`, other characters as '-', at most 128."""
    job = re.sub(r"[^A-Za-z0-9._:/+@=-]+", "-", run_key).lstrip("._:/+@=-") or "run"
    return job[:128]


def slug(text: str) -> str:
    """A run id such as `manual__2026-01-01T00:00:00+00:00` as a safe folder name: one path
    component, never `.` or `..` (a run id is user input: it must not climb out of runs/)."""
    name = re.sub(r"\.{2,}", "_", re.sub(r"[^A-Za-z0-9_.-]+", "_", text)).strip("._")
    return name or "run"


def run_folder(dag_id: str, run_id: str) -> Path:
    """The folder of one DAG run: every task of the run writes under it, so a retry
    finds what the first try left and a second DAG run never collides with the first."""
    return work_root() / "runs" / slug(dag_id) / slug(run_id)
