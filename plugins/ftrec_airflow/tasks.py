"""The bodies of the training DAGs' tasks, in TaskFlow form: upstream results in, `params`
from the task's context (made a typed RunParams at once, and only that is handed down), a
small JSON-able dict out. `pipeline.TrainingDag` makes tasks of
these functions as they are; the work itself is in `pipeline_ops` (no Airflow there).

A user error becomes `AirflowFailException` (fail now, no retry); anything else raises as
is and the task's retries apply. Heavy packages are imported inside the functions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from airflow.sdk import Asset, get_current_context
from airflow.sdk.exceptions import AirflowFailException

from ftrec_airflow import eval_split, pipeline_ops, settings
from ftrec_airflow.pipeline_ops import TrainedRun
from ftrec_airflow.run_params import RunParams

# An event per gated registration (register_model's outlet): downstream DAGs schedule on it;
# its extra says which version, its aliases and gate value (challenger only, or champion too).
MODEL = Asset(name="ftrec_model", uri="ftrec://model/registered")
log = logging.getLogger(__name__)


def run_dir() -> Path:
    """The current DAG run's folder (settings.run_folder)."""
    ctx = get_current_context()
    return settings.run_folder(ctx["ti"].dag_id, ctx["run_id"])


def _user_errors(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except pipeline_ops.UserError as e:
        raise AirflowFailException(str(e)) from None


def _params(params: Any) -> RunParams:
    """The task's params as the typed record; a value of the wrong type fails the task now."""
    return _user_errors(RunParams.of, params)


def topology(p: RunParams) -> tuple[int, int, int]:
    r, k, w = p.replica_groups, p.ranks_per_group, p.world_size
    if w not in (None, r * k):
        raise AirflowFailException(
            f"param world_size={w} must equal replica_groups*ranks_per_group={r * k}; leave it empty"
        )
    return r, k, r * k


# ---------------------------------------------------------------- shards


def ingest_validate(params=None) -> dict[str, Any]:
    """Find the data the data_source param names and check it reads, and the split params against its format."""
    return _ingest(_params(params), {})


def _ingest(p: RunParams, event_window: dict[str, int]) -> dict[str, Any]:
    """pipeline_ops.ingest of the params' data, with the triggering event's window ("window");
    the split its shards get (run_split) is checked and logged here, the run's first task."""
    topology(p)
    data = _user_errors(
        pipeline_ops.ingest,
        p.data_source,
        p.data_format,
        run_dir(),
        synth_users=p.synth_users,
        synth_items=p.synth_items,
        seed=p.seed,
    )
    data = {**data, "window": event_window}
    split = run_split(data, p)
    log.info("split: %s (%s)", split.split, eval_split.describe(split))
    return data


def run_split(data: dict, p: RunParams) -> eval_split.RunSplit:
    """The split of the shards of ingest's `data` (eval_split.resolve of its format and the
    triggering event's window, and the split params); AirflowFailException on a bad value."""
    from dataprep.readers import TIME_FORMATS

    return _user_errors(eval_split.resolve, data["format"], p.split_params(), data.get("window") or {}, TIME_FORMATS)


def shard_spec(data: dict, params=None) -> pipeline_ops.ShardSpec:
    """The shard set to build from ingest's `data`, balanced for the model trained, split as
    the params and the triggering event say (run_split)."""
    p = _params(params)
    split = run_split(data, p)
    return pipeline_ops.ShardSpec(
        input=data["path"],
        fmt=data["format"],
        out=str(run_dir() / "shards"),
        world_size=topology(p)[2],
        batch_size=p.batch_size,
        max_len=p.max_len,
        seed=p.seed,
        model_overrides=list(p.train_overrides),
        **split.build_args(),
    )


def verify_shards(shards: dict) -> dict[str, Any]:
    """Checksums, schema and coverage of the built set; its summary."""
    return _user_errors(pipeline_ops.check_shards, shards["path"])


# ---------------------------------------------------------------- train


def train_spec(shards: dict, base: dict | None = None, params=None) -> pipeline_ops.TrainSpec:
    """What to train on the verified `shards`; `base` (from base_model) warm-starts from an earlier model."""
    p = _params(params)
    r, k, _ = topology(p)
    overrides = [*p.train_overrides, f"train.seed={p.seed}"]
    if base and base.get("checkpoint"):
        overrides.append(f"train.init_checkpoint={base['checkpoint']}")
    return pipeline_ops.TrainSpec(
        shards=shards["path"],
        out=str(run_dir() / "train"),
        replica_groups=r,
        ranks_per_group=k,
        fault_plan=p.fault_plan,
        max_steps=p.max_steps,
        epochs=p.epochs,
        experiment=p.mlflow_experiment,
        overrides=overrides,
    )


# ---------------------------------------------------------------- the quality gate


def _champion(p: RunParams, run: TrainedRun) -> tuple[dict | None, str, str | None]:
    """(the champion version, its checkpoint to score, why it cannot be scored): no checkpoint
    to score when there is no champion or it is this very run (a re-run of the DAG run)."""
    from ftrec_airflow import mlflow_registry

    champ = mlflow_registry.by_alias(p.model_name, mlflow_registry.CHAMPION, run.tracking_uri)
    if champ is None or champ["run_id"] == run.mlflow_run_id:
        return champ, "", None
    ckpt = champ["tags"].get(mlflow_registry.CHECKPOINT_TAG, "")
    return champ, ckpt, None if ckpt else f"version {champ['version']} has no {mlflow_registry.CHECKPOINT_TAG} tag"


def evaluate(trained: dict, params=None) -> dict[str, Any]:
    """Evaluate the trained checkpoint and re-score the registry's champion with the same
    evaluation on the same (this run's) test split (pipeline_ops.judge). The trainer already
    logs its final valid/ and test/ metrics on the run: only metrics the run lacks are added.
    Returns the values the run shows and the champion's (the gate's input)."""
    from ftrec_airflow import mlflow_registry

    mlflow_registry.connect()
    run = TrainedRun.from_dict(trained)
    uri, run_id = run.tracking_uri, run.mlflow_run_id
    champ, ckpt, error = _champion(_params(params), run)
    res = _user_errors(pipeline_ops.judge, run.checkpoint, run.shards, str(run_dir() / "eval.json"), champion=ckpt)
    metrics = {mlflow_registry.metric_key(k): v for k, v in res["metrics"].items()}  # the names MLflow shows
    have = mlflow_registry.run_metrics(run_id, uri)
    for k in sorted(set(metrics) & set(have)):
        if abs(metrics[k] - have[k]) > 1e-6:  # same checkpoint, same protocol: should not happen
            log.warning(
                "%s: the trainer logged %.6f, evaluation gives %.6f; keeping the run's value", k, have[k], metrics[k]
            )
    mlflow_registry.log_metrics(run_id, metrics, tracking_uri=uri)
    _log_judged(run, res.get("split") or {})
    shown = {k: have.get(k, v) for k, v in metrics.items()}
    if champ is not None and not ckpt and error is None:  # the champion is this run's model
        scored = shown
    else:
        scored = {mlflow_registry.metric_key(k): float(v) for k, v in (res.get("champion") or {}).items()}
    return {
        "mlflow_run_id": run_id,
        "metrics": shown,
        "logged": sorted(set(metrics) - set(have)),
        "champion": {
            "version": champ["version"] if champ else None,
            "metrics": scored if champ else None,
            "error": error or res.get("champion_error"),
        },
        "split": res.get("split", {}),
    }


def _log_judged(run: TrainedRun, identity: dict) -> None:
    """The split and window both models were scored on (eval_split.judged): in the task log
    and as the run's MLflow params gate.split, gate.split_cut, gate.split_horizon."""
    from ftrec_airflow import mlflow_registry

    w = eval_split.judged(identity)
    c = mlflow_registry.client(run.tracking_uri)
    params = {"gate.split": w["split"], "gate.split_cut": w["cut"], "gate.split_horizon": w["horizon"]}
    for k, v in params.items():
        c.log_param(run.mlflow_run_id, k, v)
    window = f" at cut {w['cut']}, horizon {w['horizon']} s" if w["split"] == "temporal" else ""
    log.info("gate: champion and challenger judged on this run's %s split%s", w["split"], window)


def verdict_words(result: dict) -> str:
    """register_model's verdict in words: promoted, awaiting approval, or kept champion."""
    if result["promoted"]:
        return "promoted"
    return "awaiting approval" if result["approval"]["asked"] else "kept champion"


def _log_gate(run: TrainedRun, result: dict, champion: dict, p: RunParams) -> None:
    """Both scores, the split's identity and the verdict: on the challenger's MLflow run and in the task log."""
    from ftrec_airflow import mlflow_registry

    uri, run_id = run.tracking_uri, run.mlflow_run_id
    gate = {f"gate/challenger/{k}": v for k, v in result["scores"]["challenger"].items()}
    gate |= {f"gate/champion/{k}": v for k, v in result["scores"]["champion"].items() if v is not None}
    mlflow_registry.log_metrics(run_id, gate, tracking_uri=uri)
    tags = {
        "gate.metric": result["gate_metric"],
        "gate.split_fingerprint": result["split_fingerprint"],
        "gate.eval_sha256": result["eval_sha256"],
        "gate.champion_version": str(champion.get("version")),
        "gate.verdict": verdict_words(result),
        "gate.reason": result["reason"],
        "gate.min": str(p.gate_min),
        "gate.min_margin": str(p.gate_min_margin),
    }
    c = mlflow_registry.client(uri)
    for k, v in tags.items():
        c.set_tag(run_id, k, v)
    for who in ("challenger", "champion"):
        for k, v in result["scores"][who].items():
            log.info("gate: %s %s = %s", who, k, "not scored" if v is None else f"{v:.6f}")
    log.info("gate: split fingerprint %s (eval.parquet %s)", result["split_fingerprint"], result["eval_sha256"])
    log.info("gate verdict: %s (%s)", tags["gate.verdict"], result["reason"])


def _gate_verdict(p: RunParams, evaluation: dict) -> tuple[str, str, float, bool, str]:
    """(metric, its secondary twin, the challenger's value, promote?, why); fails the task
    below gate_min."""
    metric, secondary = pipeline_ops.metric_pair(p.gate_metric)
    try:
        value = pipeline_ops.check_gate(evaluation["metrics"], metric, p.gate_min)
    except (pipeline_ops.GateFailed, pipeline_ops.UserError) as e:
        raise AirflowFailException(str(e)) from None
    champion = evaluation.get("champion") or {}
    scored, error = champion.get("metrics"), champion.get("error")
    if scored is not None and metric not in scored and not error:
        error = f"it was scored on the test split only, and gate_metric is {metric}"
    champ_value = None if scored is None else scored.get(metric)
    won, why = pipeline_ops.verdict(value, champ_value, p.gate_min_margin, error)
    return metric, secondary, value, won, why


def register_model(trained: dict, evaluation: dict, params=None) -> dict[str, Any]:
    """Register the run's model if it reaches gate_min (fail with the metrics if not), as
    `challenger`, and as `champion` when it beats the champion re-scored on the same split
    by gate_min_margin (pipeline_ops.verdict, mlflow_registry.promote); the MODEL outlet
    event carries the result."""
    from ftrec_airflow import mlflow_registry

    p, run = _params(params), TrainedRun.from_dict(trained)
    metric, secondary, value, won, why = _gate_verdict(p, evaluation)
    champion = evaluation.get("champion") or {}
    mlflow_registry.connect()
    uri, split = run.tracking_uri, evaluation.get("split") or {}
    ctx = get_current_context()
    tags: dict[str, Any] = {
        "gate_metric": metric,
        "gate_value": repr(value),
        "gate_min": str(p.gate_min),
        "gate_split_fingerprint": str(split.get("fingerprint", "")),
        mlflow_registry.CHECKPOINT_TAG: run.checkpoint,
        "shards": run.shards,
        "airflow.dag_id": ctx["ti"].dag_id,
        "airflow.run_id": ctx["run_id"],
    }
    reg = mlflow_registry.register(run.mlflow_run_id, p.model_name, tags=tags, tracking_uri=uri)
    ask = p.champion_approval  # a winner waits for approve_champion's Approve
    promo = mlflow_registry.promote(
        p.model_name,
        reg["version"],
        won=won and not ask,
        reason=f"{why}; champion once approved (param champion_approval)" if won and ask else why,
        judged=champion.get("version"),
        tracking_uri=uri,
        log=log.info,
    )
    result = {**reg, **promo, "gate_metric": metric, "gate_value": value}
    asked = ask and won and promo["champion"] != reg["version"]  # a retry after the approval asks nothing
    result["approval"] = {"asked": asked, "hours": p.champion_approval_hours, "reason": why}
    result["approval"] |= {"judged": champion.get("version"), "tracking_uri": uri} if asked else {}
    result["scores"] = {
        who: {k: (m or {}).get(k) for k in (metric, secondary)}
        for who, m in (("challenger", evaluation["metrics"]), ("champion", champion.get("metrics")))
    }
    result["split_fingerprint"], result["eval_sha256"] = split.get("fingerprint", ""), split.get("eval_sha256", "")
    _log_gate(run, result, champion, p)
    ctx["outlet_events"][MODEL].extra = {
        k: result[k] for k in ("name", "version", "aliases", "run_id", "champion", "gate_metric", "gate_value")
    }
    return result


def promote_champion(registered: dict) -> dict[str, Any]:
    """After approve_champion's Approve, point `champion` at the version register_model held back
    (mlflow_registry.promote: never over a champion that moved since it was judged), and tag the
    version with who approved it. Where no approval was asked, register_model's verdict stands."""
    from ftrec_airflow import mlflow_registry

    held = registered["approval"]
    if not held["asked"]:
        log.info("no approval was asked: register_model's verdict stands (champion %s)", registered["champion"])
        return {"asked": False, "champion": registered["champion"], "promoted": registered["promoted"]}
    answer = get_current_context()["ti"].xcom_pull(task_ids="approve_champion") or {}
    who = (answer.get("responded_by_user") or {}).get("name", "unknown")
    name, version, uri = registered["name"], registered["version"], held["tracking_uri"]
    mlflow_registry.connect()
    promo = mlflow_registry.promote(
        name,
        version,
        won=True,
        reason=f"approved by {who}: {held['reason']}",
        judged=held["judged"],
        tracking_uri=uri,
        log=log.info,
    )
    if promo["champion"] == version:  # not where the champion moved since it was judged
        mlflow_registry.client(uri).set_model_version_tag(name, str(version), "champion_approved_by", who)
    return {"asked": True, "approved_by": who, **promo}


# ---------------------------------------------------------------- ftrec_retrain


def _triggering_extras() -> list[dict[str, Any]]:
    """The extras of the Asset events that triggered this run, newest first."""
    events = get_current_context().get("triggering_asset_events") or {}
    return [getattr(ev, "extra", None) or {} for evs in events.values() for ev in reversed(list(evs))]


def new_data_source(p: RunParams) -> tuple[str, str]:
    """(source, format): the newest triggering Asset event's {"path", "format"} extra when
    the run was triggered by new interaction data, else the params."""
    for extra in _triggering_extras():
        if extra.get("path"):
            return extra["path"], extra.get("format", p.data_format)
    return p.data_source, p.data_format


def new_data_window() -> dict[str, int]:
    """The {"cut", "horizon"} (those given) of the newest triggering Asset event that carries
    either, checked (eval_split.event_window); {} when none does."""
    for extra in _triggering_extras():
        if extra.get("cut") is not None or extra.get("horizon") is not None:
            return _user_errors(eval_split.event_window, extra)
    return {}


def ingest_new_data(params=None) -> dict[str, Any]:
    """ingest_validate on the data a triggering Asset event announced (else the params'), its
    shards split at the event's window where it gives one (eval_split: the params' win when set)."""
    p = _params(params)
    source, fmt = new_data_source(p)
    return _ingest(dataclasses.replace(p, data_source=source, data_format=fmt), new_data_window())


def base_model(params=None) -> dict[str, Any]:
    """The champion (`models:/<name>@champion`) and its checkpoint, not the newest version
    (a newer one may have lost to it); {} when there is no champion: train from scratch."""
    from ftrec_airflow import mlflow_registry

    p = _params(params)
    uri, _ = mlflow_registry.connect()
    champ = mlflow_registry.by_alias(p.model_name, mlflow_registry.CHAMPION, uri)
    if not champ:
        log.info("model %s has no %s: training from scratch", p.model_name, mlflow_registry.CHAMPION)
        return {}
    ckpt = champ["tags"].get(mlflow_registry.CHECKPOINT_TAG, "")
    if ckpt and not Path(ckpt).exists():
        log.warning("champion version %s's checkpoint %s is gone: training from scratch", champ["version"], ckpt)
    return {
        "version": champ["version"],
        "run_id": champ["run_id"],
        "alias": mlflow_registry.CHAMPION,
        "checkpoint": ckpt if ckpt and Path(ckpt).exists() else "",
    }


# ---------------------------------------------------------------- ftrec_chaos_drill


def check_recovery(trained: dict, params=None) -> dict[str, Any]:
    """Fail unless MLflow shows the recovery, survivors kept committing for no longer than
    the max_stall_s param between commits, and the final replicas are identical (chaos)."""
    from ftrec_airflow import chaos, mlflow_registry

    mlflow_registry.connect()
    run = TrainedRun.from_dict(trained)
    timeline_path = Path(run.out) / "timeline.json"
    if not timeline_path.exists():
        raise AirflowFailException(f"{timeline_path} is missing: the drill needs the ftcore launcher's timeline")
    timeline = json.loads(timeline_path.read_text())
    c = mlflow_registry.client(run.tracking_uri)
    metrics = dict(c.get_run(run.mlflow_run_id).data.metrics)
    artifacts = [a.path for a in c.list_artifacts(run.mlflow_run_id)]
    plan = chaos.load_plan(run.fault_plan or "{}")
    verdict = chaos.judge(
        timeline,
        metrics,
        plan,
        replica_groups=run.replica_groups,
        max_stall_s=_stall_bound(_params(params)),
        artifacts=artifacts,
    )
    if not verdict.ok:
        raise AirflowFailException("chaos drill failed: " + "; ".join(verdict.problems))
    return {"ok": True, **verdict.facts}


def _stall_bound(p: RunParams) -> float:
    if p.max_stall_s is None:
        raise AirflowFailException("check_recovery needs the max_stall_s param (ftrec_chaos_drill's)")
    return p.max_stall_s
