"""MLflow from the Airflow side: one run per DAG run's training, found again on retry; evaluation
metrics on that run; registration behind the quality gate, with the `champion`/`challenger`
aliases; links to the UI.

The long form: docs/airflow.md, "plugins/ftrec_airflow/mlflow_registry"."""

import os
import re
import time
from typing import Any

from ftrec_airflow import settings

RUN_KEY_TAG = "ftrec.airflow_run"  # "<dag_id>/<run_id>/<task_id>": the idempotency key
CHECKPOINT_TAG = "ftrec.checkpoint"
CHAMPION, CHALLENGER = "champion", "challenger"  # registry aliases


def connect() -> tuple[str, dict[str, str]]:
    """(tracking URI, credentials) of this task (settings.mlflow_connection), with the
    credentials set in this process's environment, where MLflow's client reads them.
    Each Airflow task runs in a process of its own: nothing leaks into another task."""
    uri, creds = settings.mlflow_connection()
    for k in settings.MLFLOW_CREDENTIALS:
        if k in creds:
            os.environ[k] = creds[k]
        else:
            os.environ.pop(k, None)
    return uri, creds


def client(tracking_uri: str | None = None):
    from mlflow.tracking import MlflowClient

    uri = tracking_uri or settings.tracking_uri()
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def ensure_experiment(name: str, tracking_uri: str | None = None) -> str:
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return c.create_experiment(name, artifact_location=settings.artifact_root(tracking_uri))
    except Exception:
        # Another task created it between our lookup and our create.
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def ensure_run(
    experiment: str,
    run_key: str,
    *,
    run_name: str = "",
    tags: dict[str, str] | None = None,
    tracking_uri: str | None = None,
) -> tuple[str, str]:
    """(experiment_id, run_id) of the run tagged `run_key`, created if there is none."""
    c = client(tracking_uri)
    exp_id = ensure_experiment(experiment, tracking_uri)
    escaped = run_key.replace("'", "\\'")
    found = c.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{escaped}'", max_results=1)
    if found:
        return exp_id, found[0].info.run_id
    run = c.create_run(exp_id, run_name=run_name or None, tags={RUN_KEY_TAG: run_key, **(tags or {})})
    return exp_id, run.info.run_id


def run_url(experiment_id: str, run_id: str) -> str:
    return f"{settings.mlflow_ui()}/#/experiments/{experiment_id}/runs/{run_id}"


def metric_key(name: str) -> str:
    """An MLflow-legal metric name: MLflow refuses '@', which ranking metrics use (hr@10)."""
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", name.replace("@", "_at_"))


def log_metrics(run_id: str, metrics: dict[str, float], *, prefix: str = "", tracking_uri: str | None = None) -> None:
    """Log `metrics` on the run once: metrics the run already has are not logged again,
    so a retried task adds nothing."""
    from mlflow.entities import Metric

    have = run_metrics(run_id, tracking_uri)
    now = int(time.time() * 1000)
    batch = [
        Metric(metric_key(prefix + k), float(v), now, 0)
        for k, v in metrics.items()
        if metric_key(prefix + k) not in have
    ]
    if batch:
        client(tracking_uri).log_batch(run_id, metrics=batch)


def run_metrics(run_id: str, tracking_uri: str | None = None) -> dict[str, float]:
    return dict(client(tracking_uri).get_run(run_id).data.metrics)


def register(
    run_id: str,
    name: str,
    *,
    artifact_path: str = "model",
    tags: dict[str, str] | None = None,
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Register the run's logged model as a new version of `name`, once per run:
    a retried task finds the version it created and returns it."""
    import mlflow

    c = client(tracking_uri)
    for mv in c.search_model_versions(f"name = '{name}'"):
        if mv.run_id == run_id:
            return {"name": name, "version": int(mv.version), "run_id": run_id, "reused": True}
    mlflow.set_tracking_uri(tracking_uri or settings.tracking_uri())
    mlflow.set_registry_uri(tracking_uri or settings.tracking_uri())
    mv = mlflow.register_model(f"runs:/{run_id}/{artifact_path}", name, tags=tags or {})
    return {"name": name, "version": int(mv.version), "run_id": run_id, "reused": False}


def _version(mv) -> dict[str, Any]:
    return {
        "name": mv.name,
        "version": int(mv.version),
        "run_id": mv.run_id,
        "tags": dict(mv.tags or {}),
        "aliases": sorted(mv.aliases or []),
    }


def by_alias(name: str, alias: str, tracking_uri: str | None = None) -> dict[str, Any] | None:
    """The version of `name` that `alias` points to, with its tags; None when there is none."""
    from mlflow.exceptions import MlflowException

    c = client(tracking_uri)
    try:
        # a missing alias is an INVALID_PARAMETER_VALUE of get_model_version_by_alias, like any
        # bad argument: ask the model's aliases first instead of guessing from the message
        if alias not in c.get_registered_model(name).aliases:
            return None
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":  # no such model
            return None
        raise
    return _version(c.get_model_version_by_alias(name, alias))


def promote(
    name: str,
    version: int,
    *,
    won: bool,
    reason: str,
    judged: int | None,
    tracking_uri: str | None = None,
    log=print,
) -> dict[str, Any]:
    """Point `challenger` at `version`, and `champion` too when it `won` against champion
    version `judged` (None: there was none), scored on the same split (pipeline_ops.verdict says
    `reason`). A loser never gets `champion`; neither does a winner when the champion moved
    since it was judged (another run promoted one: re-run to judge against it). Safe to
    repeat: a retry finds the aliases where the first try put them."""
    c = client(tracking_uri)
    c.set_registered_model_alias(name, CHALLENGER, str(version))
    champ = by_alias(name, CHAMPION, tracking_uri)
    now = champ["version"] if champ else None
    if now == version:
        won, reason = False, "already the champion"
    elif now != judged:
        won = False
        reason = f"the champion is version {now}, not version {judged} it was judged against: keeping it"
    if won:
        c.set_registered_model_alias(name, CHAMPION, str(version))
    champion = version if won else now
    log(f"model {name} version {version}: {reason}; the champion is version {champion}")
    aliases = sorted(c.get_model_version(name, str(version)).aliases or [])
    return {"champion": champion, "promoted": won, "aliases": aliases, "reason": reason}
