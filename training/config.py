"""The trainer's one typed configuration: dataclasses with defaults that train well,
loaded from a TOML file and overridden on the command line with `--set a.b=v`.

Every component receives its own section (`cfg.model`, `cfg.optim`, ...); nothing reads
ad-hoc globals. `ConfigError` carries a one-line message for the user.
"""

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from training.comm.config import CommConfig, checks as comm_checks


class ConfigError(ValueError):
    """A configuration the user gave cannot be used; the message says which setting."""


@dataclass
class DataConfig:
    shards: str = ""              # shard-set folder written by `python -m dataprep shards`
    prefetch: int = 2             # row groups (steps) read ahead by the background thread
    pad_to_max_len: bool = False  # pad every batch to manifest max_len (the padded baseline)


@dataclass
class ModelConfig:
    attention: str = "sasrec"     # "sasrec" (softmax) or "hstu" (pointwise SiLU-gated)
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 1
    dropout: float = 0.3
    max_len: int = 0              # 0: take it from the manifest (dataprep's max_len)
    similarity: str = "dot"       # "dot" or "cosine" (L2-normalized; then use loss.temperature ~0.05)
    # HSTU's relative attention bias (SASRec ignores it): "pos+time" (position buckets, plus
    # time-gap buckets when the shards have timestamps), "pos" or "none"
    rel_bias: str = "pos+time"
    rel_pos_buckets: int = 32     # distances below half of this are exact, the rest log-spaced to max_len
    rel_time_buckets: int = 128   # floor(ln(gap seconds) / 0.301), capped


@dataclass
class LossConfig:
    kind: str = "sampled_softmax"  # "sampled_softmax" (shared negatives) or "bce" (one negative)
    num_negatives: int = 1024      # shared negatives per step for sampled softmax
    temperature: float = 1.0       # logits = similarity / temperature
    # "step": divide by this step's all-reduced target count (the gradient of one big batch);
    # "epoch" (default): by the epoch's mean global count per step, so every token weighs the
    # same over the epoch. Balanced shards sort histories by cost inside windows, so steps
    # differ in token count; "step" then up-weights short-history tokens (BENCHMARKS.md,
    # window K table: beauty HR@10 0.4554 with "step" vs 0.4717 with "epoch" at K=64).
    normalize: str = "epoch"


@dataclass
class OptimConfig:
    lr: float = 3e-3               # AdamW on dense parameters
    embedding_lr: float = 3e-3     # Adam on the item table (its own param group, no weight decay)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    warmup_steps: int = 100
    decay: str = "cosine"          # "cosine", "linear" or "constant" after warmup
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0         # max global grad norm; 0 disables clipping


@dataclass
class TrainConfig:
    out: str = "work/train"
    epochs: int = 20
    max_steps: int = 0             # 0: epochs * steps per epoch
    max_minutes: float = 0.0       # wall-clock budget; the schedule is fitted to it at 25% (then test)
    seed: int = 0
    resume: bool = False           # continue from the newest checkpoint under out/checkpoints
    init_checkpoint: str = ""      # warm start: an earlier run's checkpoint folder (weights only)
    stop_at_step: int = 0          # leave after committing this step, schedule unchanged (preemption, tests)
    checkpoint_every: int = 500    # steps; 0: only at the end
    keep_checkpoints: int = 2
    eval_every: int = 0            # steps between validations; 0: once per epoch
    log_every: int = 20            # steps aggregated into one MLflow log call
    deterministic: bool = True


@dataclass
class EvalConfig:
    batch_size: int = 1024
    ks: tuple[int, ...] = (1, 5, 10, 50)
    num_negatives: int = 100       # sampled protocol: uniform items the user never interacted with
    seed: int = 12345              # fixed: every run ranks against the same negatives
    exclude_history: bool = True   # full ranking: items already in the user's history rank last
    periodic: bool = True          # validate every train.eval_every steps (0: once per epoch)
    final: bool = True             # valid + test at the end (into result.json)
    # "valid/sampled/ndcg@10" etc.: the run's model is the one where this validation metric
    # peaked (periodic validations and the end), written to OUT/best/ when it is not the last
    best_metric: str = ""


@dataclass
class MlflowConfig:
    enabled: bool = True
    tracking_uri: str = ""         # "" : MLFLOW_TRACKING_URI, else sqlite:///<out>/mlflow.db
    experiment: str = "ftrec"
    run_id: str = ""               # resume this run (a retried task) instead of creating one
    run_name: str = ""
    register: bool = True
    model_name: str = "ftrec"
    log_model: bool = True
    plots: bool = True
    system_metrics: bool = True    # MLflow's system/* metrics (CPU, memory, GPU) while the run trains


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    comm: CommConfig = field(default_factory=CommConfig)   # FreeScale communication (training/comm)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """`section.key -> value`, the form MLflow params take."""
        return {f"{s}.{k}": v for s, d in self.to_dict().items() for k, v in d.items()}


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Turn a TOML value or a command-line string into the field's declared type."""
    origin = getattr(typ, "__origin__", None)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if typ in (int, float, str):
            if typ is int and isinstance(value, float):
                raise ValueError(value)
            return typ(value)
        if origin is tuple:
            items = value if isinstance(value, (list, tuple)) else [v for v in str(value).strip("()[] ").split(",") if v.strip()]
            args = typ.__args__
            elem = args[0]
            return tuple(_coerce(v, elem, where) for v in items)
    except (TypeError, ValueError):
        raise ConfigError(f"setting {where}: cannot read {value!r} as {getattr(typ, '__name__', typ)}") from None
    raise ConfigError(f"setting {where}: unsupported type {typ}")


def _set(cfg: Config, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(f"setting {dotted!r}: use section.key, for example optim.lr=0.001")
    section, key = parts
    sec = getattr(cfg, section, None)
    if sec is None or not dataclasses.is_dataclass(sec):
        names = ", ".join(f.name for f in dataclasses.fields(cfg))
        raise ConfigError(f"setting {dotted!r}: unknown section {section!r} (known: {names})")
    types = {f.name: f.type for f in dataclasses.fields(sec)}
    if key not in types:
        raise ConfigError(f"setting {dotted!r}: unknown key {key!r} in [{section}] (known: {', '.join(types)})")
    setattr(sec, key, _coerce(value, types[key], dotted))


def validate(cfg: Config) -> Config:
    """Reject settings that cannot work, with the setting's name."""
    checks = [
        (cfg.model.attention in ("sasrec", "hstu"), "model.attention must be 'sasrec' or 'hstu'"),
        (cfg.model.similarity in ("cosine", "dot"), "model.similarity must be 'cosine' or 'dot'"),
        (cfg.model.rel_bias in ("pos+time", "pos", "none"), "model.rel_bias must be 'pos+time', 'pos' or 'none'"),
        (cfg.model.rel_pos_buckets >= 1 and cfg.model.rel_time_buckets >= 1,
         "model.rel_pos_buckets and model.rel_time_buckets must be >= 1"),
        (cfg.loss.kind in ("sampled_softmax", "bce"), "loss.kind must be 'sampled_softmax' or 'bce'"),
        (cfg.optim.decay in ("cosine", "linear", "constant"), "optim.decay must be 'cosine', 'linear' or 'constant'"),
        (cfg.model.dim % cfg.model.num_heads == 0, "model.dim must be divisible by model.num_heads"),
        (cfg.model.dim > 0 and cfg.model.num_layers >= 0, "model.dim must be > 0 and model.num_layers >= 0"),
        (0.0 <= cfg.model.dropout < 1.0, "model.dropout must be in [0, 1)"),
        (cfg.loss.normalize in ("step", "epoch"), "loss.normalize must be 'step' or 'epoch'"),
        (cfg.loss.num_negatives >= 1, "loss.num_negatives must be >= 1"),
        (cfg.loss.temperature > 0, "loss.temperature must be > 0"),
        (cfg.train.epochs >= 1 or cfg.train.max_steps > 0, "train.epochs must be >= 1 (or set train.max_steps)"),
        (cfg.train.log_every >= 1, "train.log_every must be >= 1"),
        (cfg.data.prefetch >= 0, "data.prefetch must be >= 0"),
        (len(cfg.eval.ks) > 0 and all(k >= 1 for k in cfg.eval.ks), "eval.ks must be positive integers"),
        (not cfg.eval.best_metric or (cfg.eval.best_metric.startswith("valid/") and cfg.eval.periodic
                                      and cfg.eval.final),
         f"eval.best_metric={cfg.eval.best_metric!r} needs a validation metric (valid/sampled/ndcg@10, "
         "valid/full/hr@10, ...) and eval.periodic=true, eval.final=true"),
    ] + comm_checks(cfg.comm)
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    return cfg


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file's sections, then `section.key=value` overrides."""
    cfg = Config()
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path} not found")
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: not valid TOML ({e})") from None
        for section, table in doc.items():
            if not isinstance(table, dict):
                raise ConfigError(f"config file {path}: top-level key {section!r} must be a [section]")
            for key, value in table.items():
                _set(cfg, f"{section}.{key}", value)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        key, value = item.split("=", 1)
        _set(cfg, key.strip(), value.strip())
    return validate(cfg)


def to_toml(cfg: Config) -> str:
    """The config as TOML text (the artifact a run logs and a checkpoint carries)."""
    lines = []
    for section, table in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
            elif isinstance(value, (list, tuple)):
                text = "[" + ", ".join(repr(v) for v in value) + "]"
            else:
                text = repr(value)
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)


def config_from_dict(doc: dict[str, Any]) -> Config:
    """The inverse of Config.to_dict (a checkpoint's meta.json).

    Keys this version no longer knows (an older checkpoint) are skipped: they cannot
    change the model that the checkpoint's tensors define.
    """
    cfg = Config()
    if "rel_bias" not in doc.get("model", {"rel_bias": None}):
        cfg.model.rel_bias = "none"   # saved before HSTU had a relative bias: its tensors have none
    for section, table in doc.items():
        sec = getattr(cfg, section, None)
        for key, value in table.items():
            if sec is not None and hasattr(sec, key):
                _set(cfg, f"{section}.{key}", value)
    return validate(cfg)
