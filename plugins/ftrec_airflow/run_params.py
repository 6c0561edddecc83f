"""The DAG run's params as one typed record (RunParams), made once at each task's boundary
(`RunParams.of(params)`) and handed down; the tasks never read a param by its string key. Each
field is one row of the training DAGs' params table: its default, its JSON schema (Airflow's
form and its checks) and its description, so `pipeline.params()` builds the DAG's Params from
the fields, never from a copy of them. A value a conf or a test gives that does not fit its
field's type is a UserError that names the param.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftrec_airflow import eval_split, pipeline_ops, settings
from ftrec_airflow.pipeline_ops import UserError

GATE_METRIC = "test/full/ndcg_at_10"  # MLflow spelling of ndcg@10, full ranking (sampled: secondary)
GATE_MIN_MARGIN = 0.001  # a challenger must beat the champion by this much on the same split


def param(default: Any, schema: dict[str, Any], description: str) -> Any:
    """A RunParams field that is a DAG param: its default (a list default is held as a tuple),
    JSON schema and description."""
    meta = {"param": (default, schema, description)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: tuple(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class RunParams:
    """A DAG run's params, typed (the module doc). The fields made by `param` are every training
    DAG's params, in the UI's order; the plain ones are a DAG's own (ftrec_chaos_drill's)."""

    data_source: str = param(
        "auto",
        {"type": "string"},
        "Interaction data: a file or folder path, 'synthetic' (generated into the run folder) "
        "or 'auto' (../shared/data/beauty.txt when present, otherwise synthetic).",
    )
    data_format: str = param(
        "iclrec",
        {"type": "string", "enum": list(pipeline_ops.FORMATS)},
        "Format of data_source: iclrec (user item item ...), sasrec (user item per line), "
        "movielens (ratings.dat/.csv), events (Parquet/CSV with user, item, timestamp).",
    )
    split: str = param(
        "auto",
        {"type": "string", "enum": list(eval_split.SPLITS)},
        "How the shard set holds out what the gate judges: temporal (train on the events up to a cut T, "
        "test each user's first event in the window after it), leave_one_out (each user's last event), or "
        "auto: temporal where data_format carries event times (events, movielens), else leave_one_out.",
    )
    split_cut: int | None = param(
        None,
        {"type": ["null", "integer"]},
        "The temporal split's cut T in epoch seconds; empty: the cut of the ftrec_interactions event "
        "that triggered the run, else the time before which 90% of the events fall.",
    )
    split_horizon: int | None = param(
        None,
        {"type": ["null", "integer"], "minimum": 1},
        "Seconds after the cut a test event may lie; empty: the triggering event's horizon, else to the last event.",
    )
    synth_users: int = param(
        2000, {"type": "integer", "minimum": 10}, "Users of generated data (data_source=synthetic)."
    )
    synth_items: int = param(
        1000, {"type": "integer", "minimum": 10}, "Items of generated data (data_source=synthetic)."
    )
    max_len: int = param(
        50,
        {"type": "integer", "minimum": 2, "maximum": 8192},
        "Longest history kept per user (most recent items).",
    )
    batch_size: int = param(
        128, {"type": "integer", "minimum": 1}, "Samples per rank and step (dataprep --batch-size)."
    )
    replica_groups: int = param(
        2,
        {"type": "integer", "minimum": 1},
        "R: data-parallel replica groups, the unit of fault tolerance (FT-HSDP).",
    )
    ranks_per_group: int = param(1, {"type": "integer", "minimum": 1}, "K: ranks inside one replica group.")
    world_size: int | None = param(
        None,
        {"type": ["null", "integer"], "minimum": 1},
        "Shard count W; empty means R*K (the only value the launcher accepts).",
    )
    shard_buckets: int | None = param(
        None,
        {"type": ["null", "integer"], "minimum": 1},
        "Buckets of the fanned-out shard build (one bucket task each); empty: as many as shard_memory_budget needs.",
    )
    shard_memory_budget: str = param(
        "",
        {"type": "string", "pattern": "^$|^[0-9]+(\\.[0-9]+)?\\s*[kKmMgGtT]?[iI]?[bB]?$"},
        "Memory one shard build task may use, like 512MB or 4GB (sets the bucket count); "
        "empty: a quarter of the worker's memory.",
    )
    epochs: int = param(0, {"type": "integer", "minimum": 0}, "Training epochs; 0 keeps the trainer's default.")
    max_steps: int = param(0, {"type": "integer", "minimum": 0}, "Stop after this many committed steps; 0: no limit.")
    fault_plan: str = param(
        "",
        {"type": "string"},
        "Faults to inject (ftcore plan): a TOML/JSON file path or inline JSON; empty for none.",
    )
    mlflow_experiment: str = param(
        settings.DEFAULT_EXPERIMENT,
        {"type": "string", "minLength": 1},
        "MLflow experiment of the training run.",
    )
    model_name: str = param(
        settings.DEFAULT_MODEL_NAME,
        {"type": "string", "minLength": 1},
        "MLflow registered model the gated model is added to.",
    )
    gate_metric: str = param(
        GATE_METRIC,
        {"type": "string"},
        "Evaluation metric of the quality gate, <split>/<protocol>/<metric> as MLflow shows it, "
        "e.g. test/full/ndcg_at_10 (ndcg@10 is accepted too); champion and challenger are both "
        "scored on this run's test split, the other protocol is logged beside it.",
    )
    gate_min: float = param(
        0.0,
        {"type": "number"},
        "The model is registered only if gate_metric >= gate_min; otherwise register_model fails.",
    )
    gate_min_margin: float = param(
        GATE_MIN_MARGIN,
        {"type": "number", "minimum": 0},
        "A registered version becomes champion only if its gate_metric beats the champion's, "
        "scored on the same test split, by at least this much.",
    )
    champion_approval: bool = param(
        False,
        {"type": "boolean"},
        "A version that beats the champion becomes champion only once a person approves it "
        "(task approve_champion, answered in the Airflow UI); until then it is challenger.",
    )
    champion_approval_hours: float = param(
        24.0,
        {"type": "number", "exclusiveMinimum": 0},
        "How long approve_champion waits for an answer; none in time counts as Reject (the champion stays).",
    )
    train_overrides: tuple[str, ...] = param(
        [],
        {"type": "array", "items": {"type": "string"}},
        "Extra trainer settings section.key=value (training/config.py), e.g. model.dim=32.",
    )
    seed: int = param(0, {"type": "integer"}, "Seed of data generation, sharding and training.")
    max_stall_s: float | None = None  # ftrec_chaos_drill's own param (check_recovery)

    @classmethod
    def of(cls, params: Mapping[str, Any] | None) -> RunParams:
        """The record of a run's `params` (Airflow's, a test's dict): each field from its key,
        the table's default where the key is missing; keys no field names are a DAG's business."""
        given = params or {}
        return cls(**{f.name: _typed(f, given[f.name]) for f in dataclasses.fields(cls) if f.name in given})

    def split_params(self) -> dict[str, Any]:
        """What eval_split.resolve reads: split, split_cut, split_horizon."""
        return {"split": self.split, "split_cut": self.split_cut, "split_horizon": self.split_horizon}


def table() -> dict[str, tuple[Any, dict[str, Any], str]]:
    """name: (default, JSON schema, description) of every DAG param, in the UI's order."""
    return {f.name: f.metadata["param"] for f in dataclasses.fields(RunParams) if "param" in f.metadata}


_KINDS = {"int": int, "float": float, "bool": bool, "str": str}
_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string"}


def _typed(f: dataclasses.Field, value: Any) -> Any:
    """`value` as field `f`'s type (its annotation's text: `int | None`, `tuple[str, ...]`);
    UserError names the param."""
    kind = str(f.type)
    optional = kind.endswith("| None")
    if value is None or (optional and value == ""):
        if optional:
            return None
        raise UserError(f"param {f.name} is empty: give it a value or leave it out for its default")
    if kind.startswith("tuple"):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise UserError(f"param {f.name}={value!r}: must be a list of strings")
        return tuple(value)
    if f.name == "fault_plan" and isinstance(value, (dict, list)):
        return json.dumps(value)  # a plan given inline as JSON
    want = _KINDS[kind.removesuffix(" | None")]
    if (want is bool) != isinstance(value, bool) or isinstance(value, float) and want is int:
        raise UserError(f"param {f.name}={value!r}: must be {_WORDS[want]}")
    try:
        return want(value)
    except (TypeError, ValueError):
        raise UserError(f"param {f.name}={value!r}: must be {_WORDS[want]}") from None
