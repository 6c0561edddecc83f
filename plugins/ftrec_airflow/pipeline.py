"""The ftrec pipeline as the DAGs call it: the params every training DAG takes, the tasks
they share (`TrainingDag`), and the body of each task (params and upstream results in, a
small JSON-able dict out).

The DAG files only say which tasks they have and wire them; this module holds the
decisions (retries, where a run's files go, which errors are worth a retry) so the DAGs
agree. A user error becomes `AirflowFailException` (fail now, no retry); anything else
raises as is and the task's retries apply.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import Asset, Param, XComArg, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException

from ftrec_airflow import pipeline_ops, settings
from ftrec_airflow.decorators import build_shards_task, ft_train_task

GATE_METRIC = "test/full/ndcg_at_10"  # MLflow spelling of ndcg@10, full ranking (sampled: secondary)
GATE_MIN_MARGIN = 0.001  # a challenger must beat the champion by this much on the same split
# An event per gated registration (register_model's outlet): downstream DAGs schedule on it;
# its extra says which version, its aliases and gate value (challenger only, or champion too).
MODEL = Asset(name="ftrec_model", uri="ftrec://model/registered")
START = datetime(2026, 1, 1)
# Every task of a training DAG (its default_args): 10 s, 20 s between tries
RETRY: dict[str, Any] = {"retries": 2, "retry_delay": timedelta(seconds=10), "retry_exponential_backoff": 2.0}
# ingest_validate reads a file: one quick retry (a mount that was late), then it is the input
INGEST_RETRY: dict[str, Any] = {"retries": 1, "retry_delay": timedelta(seconds=5), "retry_exponential_backoff": 0}
log = logging.getLogger(__name__)


def params(**defaults: Any) -> dict[str, Param]:
    """The training DAGs' params, with `defaults` replacing the default values."""
    d = {
        "data_source": "auto",
        "data_format": "iclrec",
        "synth_users": 2000,
        "synth_items": 1000,
        "max_len": 50,
        "batch_size": 128,
        "replica_groups": 2,
        "ranks_per_group": 1,
        "world_size": None,
        "epochs": 0,
        "max_steps": 0,
        "fault_plan": "",
        "mlflow_experiment": settings.DEFAULT_EXPERIMENT,
        "model_name": settings.DEFAULT_MODEL_NAME,
        "gate_metric": GATE_METRIC,
        "gate_min": 0.0,
        "gate_min_margin": GATE_MIN_MARGIN,
        "train_overrides": [],
        "seed": 0,
    }
    unknown = set(defaults) - set(d)
    if unknown:
        raise TypeError(f"unknown params: {sorted(unknown)}")
    d.update(defaults)
    return {
        "data_source": Param(
            d["data_source"],
            type="string",
            description=(
                "Interaction data: a file or folder path, 'synthetic' (generated into the run folder) "
                "or 'auto' (../shared/data/beauty.txt when present, otherwise synthetic)."
            ),
        ),
        "data_format": Param(
            d["data_format"],
            type="string",
            enum=list(pipeline_ops.FORMATS),
            description=(
                "Format of data_source: iclrec (user item item ...), sasrec (user item per line), "
                "movielens (ratings.dat/.csv), events (Parquet/CSV with user, item, timestamp)."
            ),
        ),
        "synth_users": Param(
            d["synth_users"], type="integer", minimum=10, description="Users of generated data (data_source=synthetic)."
        ),
        "synth_items": Param(
            d["synth_items"], type="integer", minimum=10, description="Items of generated data (data_source=synthetic)."
        ),
        "max_len": Param(
            d["max_len"],
            type="integer",
            minimum=2,
            maximum=8192,
            description="Longest history kept per user (most recent items).",
        ),
        "batch_size": Param(
            d["batch_size"], type="integer", minimum=1, description="Samples per rank and step (dataprep --batch-size)."
        ),
        "replica_groups": Param(
            d["replica_groups"],
            type="integer",
            minimum=1,
            description=("R: data-parallel replica groups, the unit of fault tolerance (FT-HSDP)."),
        ),
        "ranks_per_group": Param(
            d["ranks_per_group"], type="integer", minimum=1, description="K: ranks inside one replica group."
        ),
        "world_size": Param(
            d["world_size"],
            type=["null", "integer"],
            minimum=1,
            description=("Shard count W; empty means R*K (the only value the launcher accepts)."),
        ),
        "epochs": Param(
            d["epochs"], type="integer", minimum=0, description="Training epochs; 0 keeps the trainer's default."
        ),
        "max_steps": Param(
            d["max_steps"], type="integer", minimum=0, description="Stop after this many committed steps; 0: no limit."
        ),
        "fault_plan": Param(
            d["fault_plan"],
            type="string",
            description=("Faults to inject (ftcore plan): a TOML/JSON file path or inline JSON; empty for none."),
        ),
        "mlflow_experiment": Param(
            d["mlflow_experiment"], type="string", minLength=1, description="MLflow experiment of the training run."
        ),
        "model_name": Param(
            d["model_name"],
            type="string",
            minLength=1,
            description="MLflow registered model the gated model is added to.",
        ),
        "gate_metric": Param(
            d["gate_metric"],
            type="string",
            description=(
                "Evaluation metric of the quality gate, <split>/<protocol>/<metric> as MLflow shows it, "
                "e.g. test/full/ndcg_at_10 (ndcg@10 is accepted too); champion and challenger are both "
                "scored on this run's test split, the other protocol is logged beside it."
            ),
        ),
        "gate_min": Param(
            d["gate_min"],
            type="number",
            description=("The model is registered only if gate_metric >= gate_min; otherwise register_model fails."),
        ),
        "gate_min_margin": Param(
            d["gate_min_margin"],
            type="number",
            minimum=0,
            description=(
                "A registered version becomes champion only if its gate_metric beats the champion's, "
                "scored on the same test split, by at least this much."
            ),
        ),
        "train_overrides": Param(
            d["train_overrides"],
            type="array",
            items={"type": "string"},
            description=("Extra trainer settings section.key=value (training/config.py), e.g. model.dim=32."),
        ),
        "seed": Param(d["seed"], type="integer", description="Seed of data generation, sharding and training."),
    }


class TrainingDag:
    """The parts the training DAGs share, for one DAG: its `@dag` arguments and the tasks
    it builds inside its `@dag` function. A DAG file says which of them it has and how
    they connect:

        TRAIN = pipeline.TrainingDag("ftrec_train")

        @dag(**TRAIN.dag_args(__doc__, max_active_runs=4))
        def ftrec_train():
            trained = TRAIN.train(TRAIN.shards(), timeout=timedelta(hours=24))
            TRAIN.gate(trained)

    Retries are the DAG's `default_args` (RETRY); a task that differs says so here. A
    `drill` (ftrec_chaos_drill) retries nothing, since a drill that needs a second try has
    already failed, and announces no shard set (its shards are nobody's input).
    """

    def __init__(self, dag_id: str, *, drill: bool = False, shard_fanout: dict[str, Any] | None = None):
        self.dag_id = dag_id
        self.drill = drill
        # not None: build_shards as a task group of mapped tasks (shard_tasks.fanout's keywords)
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

    def shards(self, ingest: Callable[[dict], dict[str, Any]] | None = None) -> XComArg:
        """ingest_validate -> build_shards -> verify_shards; returns verify_shards' summary.
        `ingest(params)` finds the data (default `ingest_validate`: the data_source param)."""
        read = ingest or ingest_validate

        @task(task_id="ingest_validate", **({} if self.drill else INGEST_RETRY))
        def ingest_task(params=None) -> dict:
            return read(params)

        outlets = [self.shards_asset] if self.shards_asset else []

        @build_shards_task(task_id="build_shards", outlets=outlets)
        def build_task(data: dict, params=None):
            return shard_spec(params, data)

        @task(task_id="verify_shards", retries=0)  # a corrupt shard set does not heal by retrying
        def verify_task(shards: dict) -> dict:
            return verify_shards(shards)

        if self.shard_fanout is not None:
            from ftrec_airflow import shard_tasks

            built = shard_tasks.fanout(ingest_task(), shard_spec, outlets=outlets, **self.shard_fanout)
            return verify_task(built)  # type: ignore[arg-type]
        return verify_task(build_task(ingest_task()))

    def train(self, shards: XComArg, base: XComArg | None = None, *, timeout: timedelta) -> XComArg:
        """The `train` task (`@ft_train_task`) on the verified shards; `base` (a task returning
        base_model's dict) warm-starts it. Where it runs: settings.train_task_args."""

        @ft_train_task(task_id="train", **settings.train_task_args(), execution_timeout=timeout)
        def train_task(shards: dict, base: dict | None = None, params=None):
            return train_spec(params, shards, base=base)

        return train_task(shards) if base is None else train_task(shards, base)

    def gate(self, trained: XComArg) -> XComArg:
        """evaluate -> register_model behind the quality gate (an event on MODEL per version)."""

        @task(task_id="evaluate")
        def evaluate_task(trained: dict, params=None) -> dict:
            return evaluate(params, trained)

        @task(task_id="register_model", outlets=[MODEL])
        def register_task(trained: dict, evaluation: dict, params=None) -> dict:
            return register_model(params, trained, evaluation)

        # Airflow's stubs type a task's call with its function's parameters; TaskFlow passes XComArgs
        return register_task(trained, evaluate_task(trained))  # type: ignore[arg-type]


def run_dir() -> Path:
    """The current DAG run's folder (settings.run_folder)."""
    ctx = get_current_context()
    return settings.run_folder(ctx["ti"].dag_id, ctx["run_id"])


def _user_errors(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except pipeline_ops.UserError as e:
        raise AirflowFailException(str(e)) from None


def topology(p: dict) -> tuple[int, int, int]:
    r, k = int(p["replica_groups"]), int(p["ranks_per_group"])
    w = p.get("world_size")
    if w not in (None, "", r * k):
        raise AirflowFailException(
            f"param world_size={w} must equal replica_groups*ranks_per_group={r * k}; leave it empty"
        )
    return r, k, r * k


def ingest_validate(p: dict) -> dict[str, Any]:
    topology(p)
    return _user_errors(
        pipeline_ops.ingest,
        p["data_source"],
        p["data_format"],
        run_dir(),
        synth_users=int(p["synth_users"]),
        synth_items=int(p["synth_items"]),
        seed=int(p["seed"]),
    )


def shard_spec(p: dict, data: dict) -> pipeline_ops.ShardSpec:
    return pipeline_ops.ShardSpec(
        input=data["path"],
        fmt=data["format"],
        out=str(run_dir() / "shards"),
        world_size=topology(p)[2],
        batch_size=int(p["batch_size"]),
        max_len=int(p["max_len"]),
        seed=int(p["seed"]),
        model_overrides=list(p.get("train_overrides") or []),
    )  # balanced for the model trained


def verify_shards(shards: dict) -> dict[str, Any]:
    return _user_errors(pipeline_ops.verify_shards, shards["path"])


def train_spec(p: dict, shards: dict, *, base: dict | None = None) -> pipeline_ops.TrainSpec:
    """What to train; `base` (from base_model) warm-starts from an earlier model."""
    r, k, _ = topology(p)
    plan = p.get("fault_plan") or ""
    overrides = list(p.get("train_overrides") or []) + [f"train.seed={int(p['seed'])}"]
    if base and base.get("checkpoint"):
        overrides.append(f"train.init_checkpoint={base['checkpoint']}")
    return pipeline_ops.TrainSpec(
        shards=shards["path"],
        out=str(run_dir() / "train"),
        replica_groups=r,
        ranks_per_group=k,
        fault_plan=plan if isinstance(plan, str) else json.dumps(plan),
        max_steps=int(p["max_steps"]),
        epochs=int(p["epochs"]),
        experiment=p["mlflow_experiment"],
        overrides=overrides,
    )


def _champion(p: dict, trained: dict, uri: str) -> tuple[dict | None, str, str | None]:
    """(the champion version, its checkpoint to score, why it cannot be scored): no checkpoint
    to score when there is no champion or it is this very run (a re-run of the DAG run)."""
    from ftrec_airflow import mlflow_registry

    champ = mlflow_registry.by_alias(p["model_name"], mlflow_registry.CHAMPION, uri)
    if champ is None or champ["run_id"] == trained["mlflow_run_id"]:
        return champ, "", None
    ckpt = champ["tags"].get(mlflow_registry.CHECKPOINT_TAG, "")
    return champ, ckpt, None if ckpt else f"version {champ['version']} has no {mlflow_registry.CHECKPOINT_TAG} tag"


def evaluate(p: dict, trained: dict) -> dict[str, Any]:
    """Evaluate the trained checkpoint and re-score the registry's champion with the same
    evaluation on the same (this run's) test split (pipeline_ops.judge). The trainer already logs
    its final valid/ and test/ metrics on the run: only metrics the run lacks are added.
    Returns the values the run shows and the champion's (the gate's input)."""
    from ftrec_airflow import mlflow_registry

    mlflow_registry.connect()
    uri, run_id = trained["tracking_uri"], trained["mlflow_run_id"]
    champ, ckpt, error = _champion(p, trained, uri)
    res = _user_errors(
        pipeline_ops.judge, trained["checkpoint"], trained["shards"], str(run_dir() / "eval.json"), champion=ckpt
    )
    metrics = {mlflow_registry.metric_key(k): v for k, v in res["metrics"].items()}  # the names MLflow shows
    have = mlflow_registry.run_metrics(run_id, uri)
    for k in sorted(set(metrics) & set(have)):
        if abs(metrics[k] - have[k]) > 1e-6:  # same checkpoint, same protocol: should not happen
            log.warning(
                "%s: the trainer logged %.6f, evaluation gives %.6f; keeping the run's value", k, have[k], metrics[k]
            )
    mlflow_registry.log_metrics(run_id, metrics, tracking_uri=uri)
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


def _log_gate(trained: dict, result: dict, champion: dict, p: dict) -> None:
    """Both scores, the split's identity and the verdict: on the challenger's MLflow run and in the task log."""
    from ftrec_airflow import mlflow_registry

    uri, run_id = trained["tracking_uri"], trained["mlflow_run_id"]
    gate = {f"gate/challenger/{k}": v for k, v in result["scores"]["challenger"].items()}
    gate |= {f"gate/champion/{k}": v for k, v in result["scores"]["champion"].items() if v is not None}
    mlflow_registry.log_metrics(run_id, gate, tracking_uri=uri)
    tags = {
        "gate.metric": result["gate_metric"],
        "gate.split_fingerprint": result["split_fingerprint"],
        "gate.eval_sha256": result["eval_sha256"],
        "gate.champion_version": str(champion.get("version")),
        "gate.verdict": "promoted" if result["promoted"] else "kept champion",
        "gate.reason": result["reason"],
        "gate.min": str(p["gate_min"]),
        "gate.min_margin": str(p.get("gate_min_margin", GATE_MIN_MARGIN)),
    }
    c = mlflow_registry.client(uri)
    for k, v in tags.items():
        c.set_tag(run_id, k, v)
    for who in ("challenger", "champion"):
        for k, v in result["scores"][who].items():
            log.info("gate: %s %s = %s", who, k, "not scored" if v is None else f"{v:.6f}")
    log.info("gate: split fingerprint %s (eval.parquet %s)", result["split_fingerprint"], result["eval_sha256"])
    log.info("gate verdict: %s (%s)", tags["gate.verdict"], result["reason"])


def register_model(p: dict, trained: dict, evaluation: dict) -> dict[str, Any]:
    """Register the run's model if it reaches gate_min (fail with the metrics if not), as
    `challenger`, and as `champion` when it beats the champion re-scored on the same split
    by gate_min_margin (pipeline_ops.verdict, mlflow_registry.promote); the MODEL outlet event carries the result."""
    from ftrec_airflow import mlflow_registry

    metric, secondary = pipeline_ops.metric_pair(p["gate_metric"])
    try:
        value = pipeline_ops.check_gate(evaluation["metrics"], metric, float(p["gate_min"]))
    except (pipeline_ops.GateFailed, pipeline_ops.UserError) as e:
        raise AirflowFailException(str(e)) from None
    champion = evaluation.get("champion") or {}
    scored, error = champion.get("metrics"), champion.get("error")
    if scored is not None and metric not in scored and not error:
        error = f"it was scored on the test split only, and gate_metric is {metric}"
    won, why = pipeline_ops.verdict(
        value, None if scored is None else scored.get(metric), float(p["gate_min_margin"]), error
    )
    mlflow_registry.connect()
    uri, split = trained["tracking_uri"], evaluation.get("split") or {}
    ctx = get_current_context()
    tags = {
        "gate_metric": metric,
        "gate_value": repr(value),
        "gate_min": str(p["gate_min"]),
        "gate_split_fingerprint": str(split.get("fingerprint", "")),
        mlflow_registry.CHECKPOINT_TAG: trained["checkpoint"],
        "shards": trained["shards"],
        "airflow.dag_id": ctx["ti"].dag_id,
        "airflow.run_id": ctx["run_id"],
    }
    reg = mlflow_registry.register(trained["mlflow_run_id"], p["model_name"], tags=tags, tracking_uri=uri)
    promo = mlflow_registry.promote(
        p["model_name"],
        reg["version"],
        won=won,
        reason=why,
        judged=champion.get("version"),
        tracking_uri=uri,
        log=log.info,
    )
    result = {**reg, **promo, "gate_metric": metric, "gate_value": value}
    result["scores"] = {
        who: {k: (m or {}).get(k) for k in (metric, secondary)}
        for who, m in (("challenger", evaluation["metrics"]), ("champion", scored))
    }
    result["split_fingerprint"], result["eval_sha256"] = split.get("fingerprint", ""), split.get("eval_sha256", "")
    _log_gate(trained, result, champion, p)
    ctx["outlet_events"][MODEL].extra = {
        k: result[k] for k in ("name", "version", "aliases", "run_id", "champion", "gate_metric", "gate_value")
    }
    return result


# ---------------------------------------------------------------- ftrec_retrain


def new_data_source(p: dict) -> tuple[str, str]:
    """(source, format): the newest triggering Asset event's {"path", "format"} extra when
    the run was triggered by new interaction data, else the params."""
    ctx = get_current_context()
    events = ctx.get("triggering_asset_events") or {}
    for _asset, evs in events.items():
        for ev in reversed(list(evs)):
            extra = getattr(ev, "extra", None) or {}
            if extra.get("path"):
                return extra["path"], extra.get("format", p["data_format"])
    return p["data_source"], p["data_format"]


def ingest_new_data(p: dict) -> dict[str, Any]:
    source, fmt = new_data_source(p)
    return ingest_validate({**p, "data_source": source, "data_format": fmt})


def base_model(p: dict) -> dict[str, Any]:
    """The champion (`models:/<name>@champion`) and its checkpoint, not the newest version
    (a newer one may have lost to it); {} when there is no champion: train from scratch."""
    from ftrec_airflow import mlflow_registry

    uri, _ = mlflow_registry.connect()
    champ = mlflow_registry.by_alias(p["model_name"], mlflow_registry.CHAMPION, uri)
    if not champ:
        log.info("model %s has no %s: training from scratch", p["model_name"], mlflow_registry.CHAMPION)
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


def judge_drill(p: dict, trained: dict, max_stall_s: float) -> dict[str, Any]:
    """Fail unless MLflow shows the recovery, survivors kept committing and the final
    replicas are identical (ftrec_airflow.chaos)."""
    from ftrec_airflow import chaos, mlflow_registry

    mlflow_registry.connect()
    timeline_path = Path(trained["out"]) / "timeline.json"
    if not timeline_path.exists():
        raise AirflowFailException(f"{timeline_path} is missing: the drill needs the ftcore launcher's timeline")
    timeline = json.loads(timeline_path.read_text())
    c = mlflow_registry.client(trained["tracking_uri"])
    metrics = dict(c.get_run(trained["mlflow_run_id"]).data.metrics)
    artifacts = [a.path for a in c.list_artifacts(trained["mlflow_run_id"])]
    plan = chaos.load_plan(trained["fault_plan"] or "{}")
    verdict = chaos.judge(
        timeline,
        metrics,
        plan,
        replica_groups=int(trained["replica_groups"]),
        max_stall_s=max_stall_s,
        artifacts=artifacts,
    )
    if not verdict.ok:
        raise AirflowFailException("chaos drill failed: " + "; ".join(verdict.problems))
    return {"ok": True, **verdict.facts}
