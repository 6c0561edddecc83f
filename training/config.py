"""The trainer's one typed configuration: dataclasses with defaults that train well,
loaded from a TOML file and overridden on the command line with `--set section.key=value`.

A setting's documentation is the string under its field (`config --show` prints it); a
comment above a field says why its default is what it is. `--set` is one syntax wherever
ftrec takes it (`parse_overrides`): the value in TOML syntax, or else the text itself.
`ConfigError` carries a one-line message for the user.
"""

import ast
import dataclasses
import inspect
import json
import math
import os
import textwrap
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ftcore import environment
from training.comm.config import CommConfig


class ConfigError(ValueError):
    """A configuration the user gave cannot be used; the message says which setting."""


@dataclass
class DataConfig:
    """[data] the shard set the trainer reads."""

    shards: str = ""
    """shard-set folder written by `python -m dataprep shards`"""
    prefetch: int = 2
    """row groups (steps) read ahead by the background thread"""
    pad_to_max_len: bool = False
    """pad every batch to the manifest's max_len (the padded baseline)"""


@dataclass
class ModelConfig:
    """[model] the sequence recommender (training/model.py)."""

    attention: str = "sasrec"
    """"sasrec" (softmax) or "hstu" (pointwise SiLU-gated)"""
    layer: str = "standard"
    """"standard": the attention kind's own block; "ligr": eSASRec's (gated residuals, pre-norm,
    SwiGLU feed-forward; softmax attention, model.attention = "sasrec")"""
    dim: int = 64
    """width of the item embeddings and of every layer"""
    num_layers: int = 2
    """attention blocks"""
    num_heads: int = 1
    """attention heads per block; must divide dim"""
    dropout: float = 0.3
    """dropout probability in [0, 1)"""
    max_len: int = 0
    """longest history the model reads; 0 takes the manifest's (dataprep's max_len)"""
    similarity: str = "dot"
    """"dot" or "cosine" (L2-normalized; then use loss.temperature ~0.05)"""
    # "pos+time": position buckets, plus time-gap buckets when the shards have timestamps
    rel_bias: str = "pos+time"
    """HSTU's relative attention bias: "pos+time", "pos" or "none" (SASRec ignores it)"""
    rel_pos_buckets: int = 32
    """position buckets; distances below half of this are exact, the rest log-spaced"""
    rel_time_buckets: int = 128
    """time-gap buckets, floor(ln(gap seconds) / 0.301), capped"""


@dataclass
class LossConfig:
    """[loss] the training objective (training/loss.py)."""

    # the full softmax where the catalogue is small enough (training/loss.py, SOFTMAX_MAX_ITEMS):
    # on Beauty it beat the public state of the art that sampled softmax stayed below (BENCHMARKS.md)
    kind: str = "auto"
    """"auto" ("softmax" up to 32,768 items on a replicated item table, else "sampled_softmax"),
    "sampled_softmax" (loss.negatives), "softmax" (every item: the full catalogue's cross-entropy,
    N x items x dim a step; a replicated item table) or "bce" (one negative per target)"""
    num_negatives: int = 1024
    """negatives of sampled softmax: per step (loss.negatives = "shared") or per token ("per_token")"""
    # per token, every target meets its own negatives: many more items get a gradient a step
    # (the eSASRec benchmark's recipe), at N x num_negatives x dim floats a step (N: target tokens)
    negatives: str = "shared"
    """sampled softmax: "shared" (one draw per step, every token ranks against it) or "per_token"
    (each target token its own num_negatives uniform items)"""
    temperature: float = 1.0
    """logits = similarity / temperature"""
    # "step" gives the gradient of one big batch; "epoch" makes every token weigh the same
    # over the epoch. Balanced shards sort histories by cost inside windows, so steps differ
    # in token count; "step" then up-weights short-history tokens (BENCHMARKS.md, window K
    # table: beauty HR@10 0.4554 with "step" vs 0.4717 with "epoch" at K=64).
    normalize: str = "epoch"
    """"epoch": divide by the epoch's mean global target count per step; "step": by this step's"""


@dataclass
class OptimConfig:
    """[optim] optimizers and learning-rate schedule (training/state.py)."""

    lr: float = 3e-3
    """AdamW learning rate of the dense parameters"""
    embedding_lr: float = 3e-3
    """Adam learning rate of the item table (its own param group, no weight decay)"""
    item_optimizer: str = "adam"
    """the item table's Adam: "adam" (dense: every row, every step) or
    "rowwise_adam" (only the rows a step touched; lazy Adam semantics, training/state.py)"""
    weight_decay: float = 0.0
    """AdamW weight decay of the dense parameters"""
    betas: tuple[float, float] = (0.9, 0.98)
    """Adam (beta1, beta2) of both optimizers"""
    warmup_steps: int = 100
    """linear warmup steps (at most a tenth of the run)"""
    decay: str = "cosine"
    """"cosine", "linear" or "constant" after warmup"""
    min_lr_ratio: float = 0.1
    """the learning rate at the end, as a fraction of lr (cosine, linear)"""
    grad_clip: float = 1.0
    """max global gradient norm; 0 disables clipping"""


@dataclass
class TrainConfig:
    """[train] the training loop (training/train.py)."""

    out: str = "work/train"
    """work folder: checkpoints/, result.json, the default MLflow store"""
    epochs: int = 20
    """passes over the shard set"""
    max_steps: int = 0
    """stop after this many steps; 0: epochs * steps per epoch"""
    max_minutes: float = 0.0
    """wall-clock budget; the schedule is fitted to it at 25% (then test)"""
    seed: int = 0
    """seed of the initial model, dropout, negatives and the order of steps"""
    resume: bool = False
    """continue from the newest checkpoint under out/checkpoints"""
    init_checkpoint: str = ""
    """warm start: an earlier run's checkpoint folder (weights only)"""
    stop_at_step: int = 0
    """leave after committing this step, schedule unchanged (preemption, tests)"""
    checkpoint_every: int = 500
    """steps between checkpoints; 0: only at the end"""
    keep_checkpoints: int = 2
    """newest checkpoints kept; older ones are deleted"""
    eval_every: int = 0
    """steps between validations; 0: once per epoch"""
    log_every: int = 20
    """steps aggregated into one MLflow log call"""
    deterministic: bool = True
    """torch's deterministic algorithms (warn where an op has none)"""
    memory_budget_gb: float = 0.0
    """a rank's memory for the item table and its optimizer state, checked before
    the model is built (training/memory.py); 0: 80% of the device's memory (the host's, shared
    by its ranks); a replicated table over budget is sharded over the group's ranks when that fits"""


@dataclass
class EvalConfig:
    """[eval] leave-one-out evaluation (training/evaluate.py)."""

    batch_size: int = 1024
    """users scored per batch"""
    ks: tuple[int, ...] = (1, 5, 10, 50)
    """cutoffs of HR@k, NDCG@k"""
    num_negatives: int = 100
    """sampled protocol: uniform items the user never interacted with"""
    seed: int = 12345
    """seed of the sampled negatives; fixed, so every run ranks against the same ones"""
    exclude_history: bool = True
    """full ranking: items already in the user's history rank last"""
    item_chunk: int = 2048
    """full ranking: items scored at once; memory is batch_size x item_chunk scores"""
    precision: str = "auto"
    """full ranking: "fp32" scores every item in float32; "bf16" places most items by bounded bf16
    scores, the same ranks bit for bit; "auto": bf16 where the CPU runs it natively (training/ranking.py)"""
    periodic: bool = True
    """validate every train.eval_every steps (0: once per epoch)"""
    final: bool = True
    """valid + test at the end (into result.json)"""
    baseline: bool = True
    """with the final metrics: test/full/coverage@10 and the most-popular baseline's test metrics
    (baseline/popular/test/...) on the same users"""
    split: str = ""
    """the shard set's split the run expects: "leave_one_out" or "temporal" (dataprep --split);
    "": whichever it was built with"""
    # the model where this validation metric peaked (periodic validations and the end) is
    # the run's model, written to OUT/best/ when it is not the last
    best_metric: str = ""
    """"valid/full/ndcg@10" etc.: keep the model where it peaked (OUT/best/); "": the last
    (with eval.patience > 0: valid/full/ndcg@10, the full ranking the retrain gate judges)"""
    # off by default: a run trains its epochs unless asked to stop (training/selection.py)
    patience: int = 0
    """early stopping: end the run after this many validations (train.eval_every) in a row
    without a better eval.best_metric, and keep the best model; 0: never stop early"""
    # a full ranking costs items x dim per user: with a large catalogue, validating every user
    # at every train.eval_every can cost more than the training between (docs/training.md);
    # Beauty's 22,363 users took 5 s of a 25 s epoch under make run, a sample of 8,192 about 2 s
    valid_users: int = 8192
    """periodic validation, and the model selection and early stopping it feeds, score a fixed
    seeded sample of this many users (all of them when there are fewer); 0: all of them (the
    end always scores all)"""


@dataclass
class MlflowConfig:
    """[mlflow] tracking and the model registry (training/tracking.py)."""

    enabled: bool = True
    """log the run to MLflow"""
    tracking_uri: str = ""
    """"": MLFLOW_TRACKING_URI, else sqlite:///<out>/mlflow.db"""
    experiment: str = "ftrec"
    """MLflow experiment of the run"""
    run_id: str = ""
    """resume this MLflow run (a retried task) instead of creating one"""
    run_name: str = ""
    """name of a new run; "": MLflow's"""
    register: bool = True
    """register the logged model (log_model) as a new version of model_name"""
    model_name: str = "ftrec"
    """registered model the run's model is added to"""
    log_model: bool = True
    """log the trained model (an MLflow pyfunc) as the run's "model" artifact"""
    plots: bool = True
    """log PNG plots of the training curves"""
    system_metrics: bool = True
    """MLflow's system/* metrics (CPU, memory, GPU) while the run trains"""


_FT = environment.ft_defaults()  # this process's values: its environment's, else ftcore's defaults


@dataclass
class FtConfig:
    """[ft] fault tolerance across replica groups (ftcore), given to every rank as FTCORE_* variables

    The launcher hands each changed setting to every rank, and to the lighthouse it hosts, as the
    variable ftcore reads (ftcore/environment.py, FT_SETTINGS); a standing lighthouse keeps its
    own flags. The defaults are this process's values (its environment's, else ftcore's)."""

    heartbeat_timeout: float = _FT["heartbeat_timeout"]
    """seconds without a heartbeat before a rank is judged gone (FTCORE_HEARTBEAT_TIMEOUT)"""
    failure_probe: float = _FT["failure_probe"]
    """seconds a failure probe waits to hear an accused group (FTCORE_FAILURE_PROBE)"""
    stall_probe: float = _FT["stall_probe"]
    """seconds a stalled exchange or round waits before it asks for a probe (FTCORE_STALL_PROBE)"""
    join_timeout: float = _FT["join_timeout"]
    """seconds a quorum round waits for a group of the last quorum to ask (FTCORE_JOIN_TIMEOUT)"""
    collective_timeout: float = _FT["collective_timeout"]
    """seconds a cross-group exchange may take before it fails (FTCORE_COLLECTIVE_TIMEOUT)"""
    quorum_timeout: float = _FT["quorum_timeout"]
    """seconds a rank waits for a quorum reply (FTCORE_QUORUM_TIMEOUT)"""
    heal_timeout: float = _FT["heal_timeout"]
    """seconds a healing group waits for the state from its source (FTCORE_HEAL_TIMEOUT)"""
    lease: float = _FT["lease"]
    """seconds a group trains on in its last quorum while the lighthouse is silent; 0: never (FTCORE_LEASE)"""
    relay: bool = _FT["relay"]
    """a group of several ranks speaks to the lighthouse through its rank 0 (FTCORE_RELAY)"""

    def checks(self) -> list[tuple[bool, str]]:
        """ftcore's own order of its timeouts (ftcore/timeouts.py), checked before any rank starts."""
        seconds = [v for k, v in dataclasses.asdict(self).items() if k not in ("lease", "relay")]
        return [
            (all(v > 0 for v in seconds) and self.lease >= 0, "ft.* seconds must be > 0 (ft.lease >= 0)"),
            (
                self.heartbeat_timeout < self.collective_timeout <= self.quorum_timeout,
                "ft.heartbeat_timeout < ft.collective_timeout <= ft.quorum_timeout: a hang is seen by the "
                "heartbeat before an exchange gives up on it, and an exchange gives up before a quorum request",
            ),
        ]

    def changed(self) -> dict[str, Any]:
        """The settings that differ from this process's values: what the ranks must be given."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v != _FT[k]}


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    comm: CommConfig = field(default_factory=CommConfig)  # FreeScale communication (training/comm)
    ft: FtConfig = field(default_factory=FtConfig)  # fault tolerance across groups (ftcore)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """`section.key -> value`, the form MLflow params take."""
        return {f"{s}.{k}": v for s, d in self.to_dict().items() for k, v in d.items()}


def coerce(value: Any, typ: Any, where: str) -> Any:
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
            if typ is not str and isinstance(value, bool):  # true is not 1
                raise ValueError(value)
            if typ is int and isinstance(value, float):
                raise ValueError(value)
            out = typ(value)
            if typ is float and not math.isfinite(out):
                raise ValueError(value)
            return out
        if typ is list:  # a list setting's items are checked by its section's validation
            if not isinstance(value, list):
                raise ValueError(value)
            return value
        if origin is tuple:
            items = (
                value
                if isinstance(value, (list, tuple))
                else [v for v in str(value).strip("()[] ").split(",") if v.strip()]
            )
            elem = typ.__args__[0]
            return tuple(coerce(v, elem, where) for v in items)
    except (TypeError, ValueError):
        raise ConfigError(f"setting {where}: cannot read {value!r} as {getattr(typ, '__name__', typ)}") from None
    raise ConfigError(f"setting {where}: unsupported type {typ}")


def _field_types(cfg: Any, dotted: str) -> dict[str, Any]:
    """The field types of the section that `section.key` names (ConfigError if none)."""
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
    return types


def _set(cfg: Any, dotted: str, value: Any) -> None:
    types = _field_types(cfg, dotted)
    section, key = dotted.split(".")
    setattr(getattr(cfg, section), key, coerce(value, types[key], dotted))


# ---------------------------------------------------------------- --set section.key=value


def _split(item: str) -> tuple[str, str, str]:
    """`section.key=value` -> (section, key, value text), or ConfigError naming the item."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(p.strip() for p in parts):
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set train.epochs=3")
    return parts[0].strip(), parts[1].strip(), text.strip()


def parse_value(text: str) -> Any:
    """A `--set` value: a TOML value (3, 0.5, true, "text", [1, 5, 10]), or else the text as
    written (a bare string: beauty, /data/events.txt, valid/sampled/ndcg@10). Text that opens
    a quoted TOML string must close it (ValueError)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as e:
        if text[:1] in ('"', "'"):
            raise ValueError(f"{text} is not a TOML string ({e})") from None
        return text


def _items(items: Iterable[str]) -> Iterator[tuple[str, str, str, str, Any]]:
    """(item, section, key, text, value) of each `section.key=value` item."""
    for item in items:
        section, key, text = _split(item)
        try:
            value = parse_value(text)
        except ValueError as e:
            raise ConfigError(f"--set {item!r}: {e}") from None
        yield item, section, key, text, value


def parse_overrides(items: Iterable[str]) -> dict[str, dict[str, Any]]:
    """`--set` items `section.key=value` -> {section: {key: value}}, the shape of a TOML
    document (a later item for the same key wins). Each value is `parse_value`'s: a TOML
    value or, when it is not one, the text itself, so `--set train.epochs=3`,
    `--set data.name="beauty"` and `--set data.name=beauty` mean what they say.

    Knows no sections: the caller checks the names (ConfigError names a malformed item)."""
    out: dict[str, dict[str, Any]] = {}
    for _item, section, key, _text, value in _items(items):
        out.setdefault(section, {})[key] = value
    return out


def apply_overrides(cfg: Config, items: Iterable[str]) -> Config:
    """Set the trainer settings of `--set` items on `cfg` (not validated: see `validate`).
    A string setting takes the text as written unless it is a quoted TOML string, so
    `mlflow.experiment=2026` is "2026", not a number."""
    for item, section, key, text, value in _items(items):
        dotted = f"{section}.{key}"
        try:
            types = _field_types(cfg, dotted)
            _set(cfg, dotted, text if types[key] is str and not isinstance(value, str) else value)
        except ConfigError as e:
            raise ConfigError(f"--set {item!r}: {e}") from None
    return cfg


# The settings that name one of a few choices, and those choices: checked here, in one place.
CHOICES = {
    "model.attention": ("sasrec", "hstu"),
    "model.layer": ("standard", "ligr"),
    "model.similarity": ("cosine", "dot"),
    "model.rel_bias": ("pos+time", "pos", "none"),
    "loss.kind": ("auto", "sampled_softmax", "softmax", "bce"),
    "loss.negatives": ("shared", "per_token"),
    "loss.normalize": ("step", "epoch"),
    "optim.decay": ("cosine", "linear", "constant"),
    "optim.item_optimizer": ("adam", "rowwise_adam"),
    "eval.precision": ("auto", "fp32", "bf16"),
    "eval.split": ("leave_one_out", "temporal", ""),  # "": the shard set's
}


def _choice_checks(cfg: Config) -> list[tuple[bool, str]]:
    out = []
    for dotted, allowed in CHOICES.items():
        section, key = dotted.split(".")
        words = [repr(a) for a in allowed]
        said = f"{', '.join(words[:-1])} or {words[-1]}"
        out.append((getattr(getattr(cfg, section), key) in allowed, f"{dotted} must be {said}"))
    return out


def validate(cfg: Config) -> Config:
    """Reject settings that cannot work, with the setting's name."""
    checks = _choice_checks(cfg) + [
        (
            cfg.model.layer != "ligr" or cfg.model.attention == "sasrec",
            "model.layer='ligr' is a softmax-attention layer: use it with model.attention='sasrec'",
        ),
        (
            cfg.model.rel_pos_buckets >= 1 and cfg.model.rel_time_buckets >= 1,
            "model.rel_pos_buckets and model.rel_time_buckets must be >= 1",
        ),
        (cfg.model.dim % cfg.model.num_heads == 0, "model.dim must be divisible by model.num_heads"),
        (cfg.model.dim > 0 and cfg.model.num_layers >= 0, "model.dim must be > 0 and model.num_layers >= 0"),
        (0.0 <= cfg.model.dropout < 1.0, "model.dropout must be in [0, 1)"),
        (cfg.loss.num_negatives >= 1, "loss.num_negatives must be >= 1"),
        (cfg.loss.temperature > 0, "loss.temperature must be > 0"),
        (cfg.train.epochs >= 1 or cfg.train.max_steps > 0, "train.epochs must be >= 1 (or set train.max_steps)"),
        (cfg.train.log_every >= 1, "train.log_every must be >= 1"),
        (cfg.data.prefetch >= 0, "data.prefetch must be >= 0"),
        (len(cfg.eval.ks) > 0 and all(k >= 1 for k in cfg.eval.ks), "eval.ks must be positive integers"),
        (cfg.eval.item_chunk >= 1 and cfg.eval.batch_size >= 1, "eval.item_chunk and eval.batch_size must be >= 1"),
        (
            not cfg.eval.best_metric
            or (cfg.eval.best_metric.startswith("valid/") and cfg.eval.periodic and cfg.eval.final),
            f"eval.best_metric={cfg.eval.best_metric!r} needs a validation metric (valid/sampled/ndcg@10, "
            "valid/full/hr@10, ...) and eval.periodic=true, eval.final=true",
        ),
        (cfg.eval.patience >= 0, "eval.patience must be >= 0 (0: no early stopping)"),
        (cfg.eval.valid_users >= 0, "eval.valid_users must be >= 0 (0: every user)"),
        (
            cfg.eval.patience == 0 or (cfg.eval.periodic and cfg.eval.final),
            f"eval.patience={cfg.eval.patience} needs eval.periodic=true (it counts validations) and eval.final=true",
        ),
    ]
    checks += cfg.comm.checks() + cfg.ft.checks()
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    return cfg


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """A TOML config file's document (ConfigError when it is missing or not TOML)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} not found")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {path}: not valid TOML ({e})") from None


def apply_toml(cfg: Any, doc: dict[str, Any], origin: str) -> Any:
    """Set a TOML document's `[section] key = value` settings on `cfg`, a dataclass of dataclass
    sections (the trainer's Config, the scale model's SimConfig): every value turned into its
    field's type; ConfigError names the setting. The one loader of both."""
    for section, table in doc.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{origin}: top-level key {section!r} must be a [section]")
        for key, value in table.items():
            _set(cfg, f"{section}.{key}", value)
    return cfg


def load_config(path: str | None = None, overrides: Iterable[str] | None = None) -> Config:
    """Defaults, then the TOML file's sections, then `section.key=value` overrides."""
    cfg = Config()
    if path:
        apply_toml(cfg, read_toml(path), f"config file {path}")
    return validate(apply_overrides(cfg, overrides or []))


def toml_value(value: Any) -> str:
    """`value` written as TOML (what `parse_value` reads back)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's string escapes are TOML's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def to_toml(cfg: Config) -> str:
    """The config as TOML text (the artifact a run logs and a checkpoint carries)."""
    lines = []
    for section, table in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in table.items()]
        lines.append("")
    return "\n".join(lines)


def _doc(section: type) -> list[str]:
    doc = section.__doc__ or ""
    if doc.startswith(f"{section.__name__}("):  # the signature @dataclass writes when there is none
        return []
    return inspect.cleandoc(doc).splitlines()


def setting_docs(section: type) -> dict[str, str]:
    """{setting: what it does, on one line}: the string under each field of a section."""
    body = ast.parse(textwrap.dedent(inspect.getsource(section))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for field_, doc in zip(body.body, body.body[1:], strict=False):
        if isinstance(field_, ast.AnnAssign) and isinstance(field_.target, ast.Name) and isinstance(doc, ast.Expr):
            if isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                docs[field_.target.id] = " ".join(doc.value.value.split())
    return docs


def describe(cfg: Config | None = None) -> str:
    """Every setting with its value (the defaults unless `cfg`) and its one line, as a TOML
    file with comments: what `python -m training config --show` prints."""
    cfg = cfg or Config()
    lines = [
        "# The trainer's settings, as a TOML file for --config; --set section.key=value overrides",
        "# one (the value in TOML syntax; bare text is a string).",
        "",
    ]
    for sec in dataclasses.fields(cfg):
        section = getattr(cfg, sec.name)
        title = (_doc(type(section)) or [""])[0].removeprefix(f"[{sec.name}]").strip()
        lines.append(f"[{sec.name}]  # {title}" if title else f"[{sec.name}]")
        docs = setting_docs(type(section))
        for f in dataclasses.fields(section):
            text = f"{f.name} = {toml_value(getattr(section, f.name))}"
            lines.append(f"{text:<34s} # {docs[f.name]}" if f.name in docs else text)
        lines.append("")
    return "\n".join(lines)


def config_from_dict(doc: dict[str, Any]) -> Config:
    """The inverse of Config.to_dict (a checkpoint's meta.json).

    Keys this version no longer knows (an older checkpoint) are skipped: they cannot
    change the model that the checkpoint's tensors define.
    """
    cfg = Config()
    if "rel_bias" not in doc.get("model", {"rel_bias": None}):
        cfg.model.rel_bias = "none"  # saved before HSTU had a relative bias: its tensors have none
    for section, table in doc.items():
        sec = getattr(cfg, section, None)
        for key, value in table.items():
            if sec is not None and hasattr(sec, key):
                _set(cfg, f"{section}.{key}", value)
    return validate(cfg)
