"""Reusable TaskFlow decorators: `@build_shards_task` and `@ft_train_task`.

The long form: docs/airflow.md, "plugins/ftrec_airflow/decorators"."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import Asset
from airflow.sdk.bases.decorator import DecoratedOperator, determine_kwargs, task_decorator_factory
from airflow.sdk.definitions.context import context_merge
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from ftrec_airflow import lighthouse_status, mlflow_registry, pipeline_ops, runner, settings
from ftrec_airflow.links import LighthouseLink, MLflowRunLink

if TYPE_CHECKING:
    from ftrec_airflow.follow import Follower


def _spec(op: BuildShardsOperator | FaultTolerantTrainOperator, context, kind: type):
    context_merge(context, op.op_kwargs)
    kwargs = determine_kwargs(op.python_callable, op.op_args, context)
    spec = op.python_callable(*op.op_args, **kwargs)
    if not isinstance(spec, kind):
        raise TypeError(f"{op.custom_operator_name} function must return a {kind.__name__}, got {type(spec).__name__}")
    return spec


_UNKNOWN = "(Airflow could not be asked)"
STATE_ASK_S = 2.0  # how long a stopped try asks Airflow for the task's state (the supervisor's kill waits 5 s)


def _state_now(ti) -> str | None:
    """The task's state in Airflow's metadata now (None: reset, to be scheduled again), or _UNKNOWN
    when Airflow does not answer within STATE_ASK_S (or outside a supervised task). Asked from a
    thread: a signal handler that asked itself could wait forever on the comms lock its own thread holds."""
    found: list = []

    def ask() -> None:
        try:
            index = ti.map_index if ti.map_index is not None and ti.map_index >= 0 else None
            states = ti.get_task_states(dag_id=ti.dag_id, task_ids=[ti.task_id], run_ids=[ti.run_id], map_index=index)
            found.append(states[ti.run_id][ti.task_id if index is None else f"{ti.task_id}_{index}"])
        except Exception:  # noqa: BLE001 - unknown: the job is stopped, as before
            found.append(_UNKNOWN)

    asker = threading.Thread(target=ask, name="ftrec-task-state", daemon=True)
    asker.start()
    asker.join(STATE_ASK_S)
    return found[0] if found else _UNKNOWN


@contextlib.contextmanager
def _sigterm_asks_airflow(op: FaultTolerantTrainOperator, ti) -> Iterator[None]:
    """While training: a SIGTERM (Airflow's supervisor stopping this try) first asks Airflow what
    became of the task. When it runs the task again (follow.left_for_next_try: a new scheduler reset
    it, a retry is due), the job is left running for that try to follow; otherwise on_kill stops it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame) -> None:
        from ftrec_airflow import follow

        job = op._command
        if job is not None:
            state = _state_now(ti)
            why = None if state == _UNKNOWN else follow.left_for_next_try(state)
            if why:
                op.log.warning("%s", why)
                job.leave(why)
            else:
                op.log.warning("stopped with the task %s: stopping the training job", state)
        if callable(previous):
            previous(signum, frame)  # the task runner's: on_kill (a no-op on a job left running)

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class BuildShardsOperator(DecoratedOperator):
    """Builds the shard set the decorated function describes; returns its summary."""

    custom_operator_name = "@build_shards_task"

    def execute(self, context) -> dict[str, Any]:
        spec = _spec(self, context, pipeline_ops.ShardSpec)
        try:
            summary = pipeline_ops.build_shards(spec, log=self.log.info)  # each stage in the task log as it ends
        except pipeline_ops.UserError as e:
            raise AirflowFailException(str(e)) from None
        self.log.info(
            "shard set %s: %s steps, %s samples, bubble %.4f%s",
            summary["path"],
            summary["steps"],
            summary["num_samples"],
            summary["bubble_fraction"] or 0.0,
            " (reused)" if summary["reused"] else "",
        )
        for outlet in self.outlets:
            if isinstance(outlet, Asset):
                context["outlet_events"][outlet].extra = {
                    "path": summary["path"],
                    "fingerprint": summary["fingerprint"],
                    "steps": summary["steps"],
                    "num_samples": summary["num_samples"],
                }
        return summary


class FaultTolerantTrainOperator(DecoratedOperator):
    """Trains as the decorated function's TrainSpec says, on one MLflow run per task."""

    custom_operator_name = "@ft_train_task"
    operator_extra_links = (MLflowRunLink(), LighthouseLink())

    mlflow_run_url = ""
    _command: runner.Command | Follower | None = None

    def execute(self, context) -> dict[str, Any]:
        spec = _spec(self, context, pipeline_ops.TrainSpec)
        ti = context["ti"]
        uri, creds = mlflow_registry.connect()  # the ftrec_mlflow connection, looked up now (never at parse)
        run_key = spec.run_key or f"{ti.dag_id}/{ti.run_id}/{ti.task_id}"
        exp_id, run_id = mlflow_registry.ensure_run(
            spec.experiment,
            run_key,
            run_name=spec.run_name or f"{ti.dag_id} {ti.run_id}",
            tags={"airflow.dag_id": ti.dag_id, "airflow.run_id": ti.run_id, "airflow.task_id": ti.task_id},
            tracking_uri=uri,
        )
        self.mlflow_run_url = mlflow_registry.run_url(exp_id, run_id)
        ti.xcom_push(key="mlflow_run_id", value=run_id)  # visible while training runs
        self.log.info("MLflow run %s (%s), store %s", run_id, self.mlflow_run_url, uri)
        spec.run_key = run_key
        if settings.lighthouse_url():  # a standing lighthouse: this run's job on it, the worker's token
            watcher = lighthouse_status.Watcher(
                settings.run_folder(ti.dag_id, ti.run_id), job=settings.lighthouse_job_id(run_key)
            )
        else:  # the launcher's own lighthouse and its shared token
            watcher = lighthouse_status.Watcher(
                settings.run_folder(ti.dag_id, ti.run_id), token_file=Path(spec.out) / "token"
            )
        try:
            with watcher, _sigterm_asks_airflow(self, ti):
                result = pipeline_ops.run_training(
                    spec,
                    run_id,
                    uri,
                    credentials=creds,
                    logger=self.log,
                    on_line=watcher.see,
                    command_hook=lambda c: setattr(self, "_command", c),
                )
        except pipeline_ops.UserError as e:
            raise AirflowFailException(str(e)) from None
        except runner.CommandFailed as e:
            raise AirflowException(str(e)) from None  # retried: the launcher resumes from its checkpoint
        except runner.JobLeftRunning as e:  # Airflow has moved on to another try already
            raise AirflowException(f"this try ends and leaves the training job running: {e}") from None
        finally:
            self._command = None
        trained = pipeline_ops.TrainedRun.of(
            spec, result, mlflow_run_id=run_id, experiment_id=exp_id, run_url=self.mlflow_run_url, tracking_uri=uri
        )
        return trained.to_dict()

    def on_kill(self) -> None:
        if self._command is not None:
            self._command.stop()


def build_shards_task(python_callable=None, **kwargs):
    """Decorate a function returning a `ShardSpec`; accepts every operator argument."""
    return task_decorator_factory(
        python_callable=python_callable, decorated_operator_class=BuildShardsOperator, **kwargs
    )


def ft_train_task(python_callable=None, **kwargs):
    """Decorate a function returning a `TrainSpec`; accepts every operator argument."""
    return task_decorator_factory(
        python_callable=python_callable, decorated_operator_class=FaultTolerantTrainOperator, **kwargs
    )
