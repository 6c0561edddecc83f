"""The training DAGs' shared parts: the params every training DAG takes (`PARAMS`, the table of run_params.RunParams)
and the tasks they share (`TrainingDag`, which makes tasks of the bodies in `tasks` as they
are). The DAG files only say which tasks they have and wire them; this module holds the
decisions (retries, outlets, timeouts) so the DAGs agree.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any

from airflow.sdk import Asset, Param, XComArg, task

from ftrec_airflow import run_params, settings, shard_tasks, tasks
from ftrec_airflow.approval import ChampionApproval
from ftrec_airflow.decorators import build_shards_task, ft_train_task

START = datetime(2026, 1, 1)
# build_shards fanned out (shard_tasks.fanout's keywords): buckets from the memory budget
FANOUT: Mapping[str, Any] = MappingProxyType({})
# Every task of a training DAG (its default_args): 10 s, 20 s between tries
RETRY: dict[str, Any] = {"retries": 2, "retry_delay": timedelta(seconds=10), "retry_exponential_backoff": 2.0}
# ingest_validate reads a file: one quick retry (a mount that was late), then it is the input
INGEST_RETRY: dict[str, Any] = {"retries": 1, "retry_delay": timedelta(seconds=5), "retry_exponential_backoff": 0}

# name: (default, JSON schema, description): one Param each, in the UI's order (run_params.RunParams' fields)
PARAMS: dict[str, tuple[Any, dict[str, Any], str]] = run_params.table()


def params(**defaults: Any) -> dict[str, Param]:
    """The training DAGs' params (PARAMS), with `defaults` replacing the default values."""
    unknown = set(defaults) - set(PARAMS)
    if unknown:
        raise TypeError(f"unknown params: {sorted(unknown)}")
    return {
        name: Param(copy.deepcopy(defaults.get(name, default)), description=description, **copy.deepcopy(schema))
        for name, (default, schema, description) in PARAMS.items()
    }


class TrainingDag:
    """The parts the training DAGs share, for one DAG: its `@dag` arguments and the tasks it
    builds inside its `@dag` function, each a body from `tasks`; a DAG file says which it has
    and how they connect (`TRAIN.train(TRAIN.shards())`, `TRAIN.gate(trained)`). Retries are
    the DAG's `default_args` (RETRY); a `drill` retries nothing (a drill that needs a second
    try has failed) and announces no shard set. Example: docs/airflow.md, "TrainingDag"."""

    def __init__(self, dag_id: str, *, drill: bool = False, shard_fanout: Mapping[str, Any] | None = FANOUT):
        self.dag_id = dag_id
        self.drill = drill
        # build_shards as a task group of mapped tasks (shard_tasks.fanout's keywords; the
        # shard_* params come first); None: one build_shards task
        self.shard_fanout = shard_fanout
        # build_shards' outlet: an event per shard set built (path, fingerprint in its extra)
        self.shards_asset = None if drill else Asset(name=f"{dag_id}_shards", uri=f"ftrec://shards/{dag_id}")

    def dag_args(self, doc: str, *, tags: tuple[str, ...] = (), **dag: Any) -> dict[str, Any]:
        """`@dag(**...)` arguments: the shared ones, then `dag` (schedule, params, max_active_runs, ...)."""
        return {
            "dag_id": self.dag_id,
            "schedule": None,
            "start_date": START,
            "catchup": False,
            "params": params(),
            "tags": ["ftrec", *tags],
            "doc_md": doc,
            "default_args": {"retries": 0} if self.drill else dict(RETRY),
            **dag,
        }

    def shards(self, ingest: Callable[..., dict[str, Any]] = tasks.ingest_validate) -> XComArg:
        """ingest_validate -> build_shards -> verify_shards; returns verify_shards' summary.
        `ingest(params=...)` finds the data (default: the data_source param)."""
        ingested = task(task_id="ingest_validate", **({} if self.drill else INGEST_RETRY))(ingest)()
        outlets = [self.shards_asset] if self.shards_asset else []
        if self.shard_fanout is not None:
            built = shard_tasks.fanout(ingested, tasks.shard_spec, outlets=outlets, **dict(self.shard_fanout))
        else:
            built = build_shards_task(tasks.shard_spec, task_id="build_shards", outlets=outlets)(ingested)
        # a corrupt shard set does not heal by retrying
        return task(task_id="verify_shards", retries=0)(tasks.verify_shards)(built)  # type: ignore[arg-type]

    def train(self, shards: XComArg, base: XComArg | None = None, *, timeout: timedelta) -> XComArg:
        """The `train` task (`@ft_train_task`) on the verified shards; `base` (a task returning
        base_model's dict) warm-starts it. Where it runs: settings.train_task_args."""
        train = ft_train_task(
            tasks.train_spec, task_id="train", **settings.train_task_args(), execution_timeout=timeout
        )
        return train(shards) if base is None else train(shards, base)

    def gate(self, trained: XComArg) -> XComArg:
        """evaluate -> register_model behind the quality gate (an event on MODEL per version) ->
        approve_champion -> promote_champion (a person's approval where param champion_approval
        asks for one: ftrec_airflow.approval)."""
        # Airflow's stubs type a task's call with its function's parameters; TaskFlow passes XComArgs
        evaluation = task(task_id="evaluate")(tasks.evaluate)(trained)  # type: ignore[arg-type]
        register = task(task_id="register_model", outlets=[tasks.MODEL])(tasks.register_model)
        registered = register(trained, evaluation)  # type: ignore[arg-type]
        promoted = task(task_id="promote_champion")(tasks.promote_champion)(registered)  # type: ignore[arg-type]
        registered >> ChampionApproval(task_id="approve_champion") >> promoted
        return registered
