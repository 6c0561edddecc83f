"""Typed configuration of the scale model, loaded from TOML and `--set` overrides.

The defaults are the paper preset: the published FT-HSDP setting (about 98K GPUs as
12 replica groups of 8,192, a failure every 18 minutes), with the split of the
stated totals into model parameters documented in benchmarks/sim/README.md.
All times are seconds.
"""

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from training.config import ConfigError, apply_toml, coerce, parse_overrides, read_toml


class SimConfigError(ValueError):
    """A setting the user gave is wrong; the message names it and says what to do."""


@dataclass(frozen=True)
class FailureKind:
    name: str
    share: float  # fraction of failures of this kind (normalized over kinds)
    detect_s: float  # failure -> the synchronous job acts on it (crash: fast; hang: a timeout)
    ft_detect_s: float = -1  # the same under FT-HSDP's own detection; < 0: same as detect_s


@dataclass
class Job:
    gpus: int = 98_304
    replica_groups: int = 12
    gpus_per_server: int = 8
    days: float = 30.0
    seeds: int = 8
    seed: int = 0


@dataclass
class Failures:
    unit: str = "server"  # "server" or "gpu": what fails as a Poisson process
    # Per unit. 18 min x 12,288 servers = 3,686.4 h: the paper's failure every ~18 min
    # at 98,304 GPUs (about 29,500 h per GPU; Kokolis et al. report ~14 min at 131K GPUs).
    unit_mtbf_h: float = 3686.4
    overlap: str = "queue"  # failure during a recovery: "queue" its own, or "restart" it
    kinds: list = field(
        default_factory=lambda: [
            FailureKind("crash", 0.8, 30.0),  # process/server dies: connection errors surface at once
            FailureKind("hang", 0.2, 180.0),  # a rank stops answering: found by a collective timeout
        ]
    )


@dataclass
class Restart:
    """What one restart costs after detection: the whole job (synchronous) or one
    replica group (FT-HSDP, which loads state from a live peer instead of storage)."""

    reschedule_s: float = 180.0  # drain the failed server, get a spare, start the processes
    ckpt_load_s: float = 120.0  # load the last checkpoint from storage
    comm_init_s: float = 120.0  # build the communicators
    first_step_s: float = 60.0  # warm-up / compile until the first step completes


@dataclass
class Checkpoint:
    policy: str = "fixed"  # "fixed" interval_s, or "young_daly" (Daly's optimum from write_s)
    interval_s: float = 240.0  # training time between checkpoints
    write_s: float = 0.0  # blocking part of a checkpoint write (0: fully asynchronous)
    fthsdp_interval_s: float = 0.0  # FT-HSDP's own interval (it needs checkpoints only when every
    # group is down, so it can write far less often); 0: the same


@dataclass
class FTHSDP:
    reconfigure_s: float = 120.0  # global stall after detection: quorum change, FTAR reconfiguration
    heal_s: float = 120.0  # a restarted group fetches the live state from a peer (catch-up)
    join_stall_s: float = 0.0  # global stall when a healed group joins (0: a catch-up that does not block)
    min_replicas: int = 1  # fewer live groups -> the whole job waits
    step_overhead: float = 0.0  # fraction of step time the FT step protocol adds (FTAR control, vote)
    lr_policy: str = "sqrt"  # lr scale with N_live of N groups: "sqrt", "linear", "constant"
    progress: str = "samples"  # a degraded step is worth its samples ("samples") or its lr scale ("lr")


@dataclass
class Balance:
    lengths: str = "lognormal"  # "lognormal", "beauty", "video" (shared datasets) or a file path
    lognormal_median: float = 40.0
    lognormal_sigma: float = 1.2
    max_len: int = 1024  # lengths are capped here (the model's max_len)
    batch_per_rank: int = 32
    window_steps: int = 16
    windows: int = 2  # windows simulated per W (steps = windows * window_steps)
    world_sizes: list = field(default_factory=lambda: [8, 32, 128, 512, 2048, 8192])
    cost_a: float = -1.0  # c(L) = a L^2 + b L + c0; negative: from calibration or default
    cost_b: float = -1.0
    cost_c0: float = -1.0


@dataclass
class Sweep:
    scales: list = field(
        default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768, 65536, 98304, 131072, 262144, 524288]
    )
    group_gpus: int = 8192  # replica-group size held fixed along the scale sweep
    replica_groups: list = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 48, 96])
    mtbf_min: list = field(default_factory=lambda: [6, 9, 12, 18, 27, 36, 60, 120, 240])


@dataclass
class SimConfig:
    job: Job = field(default_factory=Job)
    failures: Failures = field(default_factory=Failures)
    restart: Restart = field(default_factory=Restart)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    fthsdp: FTHSDP = field(default_factory=FTHSDP)
    balance: Balance = field(default_factory=Balance)
    sweep: Sweep = field(default_factory=Sweep)

    def to_dict(self) -> dict:
        return asdict(self)


CHOICES = {
    ("failures", "unit"): ("server", "gpu"),
    ("failures", "overlap"): ("queue", "restart"),
    ("checkpoint", "policy"): ("fixed", "young_daly"),
    ("fthsdp", "lr_policy"): ("sqrt", "linear", "constant"),
    ("fthsdp", "progress"): ("samples", "lr"),
}


def _number(where: str, value) -> float:
    try:
        return coerce(value, float, where)
    except ConfigError as e:
        raise SimConfigError(str(e)) from None


def _kinds(where: str, value) -> list:
    if not isinstance(value, list) or not value:
        raise SimConfigError(f"{where}: give a non-empty list of {{name, share, detect_s}} tables")
    out = []
    for i, k in enumerate(value):
        if isinstance(k, FailureKind):
            out.append(k)
            continue
        if (
            not isinstance(k, dict)
            or set(k) - {"name", "share", "detect_s", "ft_detect_s"}
            or not {"share", "detect_s"} <= set(k)
        ):
            raise SimConfigError(
                f"{where}[{i}] = {k!r}: expected a table with share and detect_s (and optionally name, ft_detect_s)"
            )
        out.append(
            FailureKind(
                str(k.get("name", f"kind{i}")),
                _number(f"{where}[{i}].share", k["share"]),
                _number(f"{where}[{i}].detect_s", k["detect_s"]),
                _number(f"{where}[{i}].ft_detect_s", k.get("ft_detect_s", -1.0)),
            )
        )
    return out


def validate(cfg: SimConfig) -> SimConfig:
    """Raise SimConfigError naming the first setting that makes no sense."""
    j, f = cfg.job, cfg.failures
    for (sec, key), allowed in CHOICES.items():
        v = getattr(getattr(cfg, sec), key)
        if v not in allowed:
            raise SimConfigError(f"{sec}.{key} = {v!r}: choose one of {', '.join(allowed)}")
    if j.gpus < 1 or j.gpus_per_server < 1:
        raise SimConfigError("job.gpus and job.gpus_per_server must be >= 1")
    if f.unit == "server" and j.gpus % j.gpus_per_server:
        raise SimConfigError(f"job.gpus = {j.gpus} is not a multiple of job.gpus_per_server = {j.gpus_per_server}")
    units = j.gpus // j.gpus_per_server if f.unit == "server" else j.gpus
    if not 1 <= j.replica_groups <= units:
        raise SimConfigError(
            f"job.replica_groups = {j.replica_groups}: must be between 1 and the number of "
            f"failure units ({units} {f.unit}s)"
        )
    if j.days <= 0 or j.seeds < 1:
        raise SimConfigError("job.days must be > 0 and job.seeds >= 1")
    if f.unit_mtbf_h < 0:
        raise SimConfigError(f"failures.unit_mtbf_h = {f.unit_mtbf_h}: must be >= 0 (0 = no failures)")
    if any(k.share < 0 or k.detect_s < 0 for k in f.kinds) or sum(k.share for k in f.kinds) <= 0:
        raise SimConfigError("failures.kinds: shares and detect_s must be >= 0 and the shares must not all be 0")
    for section in (cfg.restart, cfg.checkpoint, cfg.fthsdp):
        for fl in fields(section):
            v = getattr(section, fl.name)
            if isinstance(v, float) and v < 0:
                raise SimConfigError(f"{type(section).__name__.lower()}.{fl.name} = {v}: must be >= 0")
    if cfg.checkpoint.policy == "fixed" and cfg.checkpoint.interval_s <= 0:
        raise SimConfigError("checkpoint.interval_s must be > 0 with policy \"fixed\" (use a huge value for 'never')")
    if cfg.fthsdp.step_overhead >= 1:
        raise SimConfigError(f"fthsdp.step_overhead = {cfg.fthsdp.step_overhead}: a fraction of step time, < 1")
    if not 1 <= cfg.fthsdp.min_replicas <= j.replica_groups:
        raise SimConfigError(
            f"fthsdp.min_replicas = {cfg.fthsdp.min_replicas}: must be between 1 and "
            f"job.replica_groups = {j.replica_groups}"
        )
    b = cfg.balance
    if b.batch_per_rank < 1 or b.window_steps < 1 or b.windows < 1 or b.max_len < 1:
        raise SimConfigError("balance.batch_per_rank, window_steps, windows and max_len must be >= 1")
    if not b.world_sizes or any(not isinstance(w, int) or w < 1 for w in b.world_sizes):
        raise SimConfigError(f"balance.world_sizes = {b.world_sizes!r}: give a list of integers >= 1")
    s = cfg.sweep
    if any(not isinstance(x, int) or x < 1 for x in s.scales + s.replica_groups) or s.group_gpus < 1:
        raise SimConfigError("sweep.scales, sweep.replica_groups and sweep.group_gpus must be integers >= 1")
    if any(not isinstance(x, (int, float)) or x <= 0 for x in s.mtbf_min):
        raise SimConfigError("sweep.mtbf_min must be numbers > 0 (job minutes between failures)")
    return cfg


def load(path: "str | Path | None" = None, overrides: "list[str] | tuple" = ()) -> SimConfig:
    """Defaults <- TOML file <- `section.key=value` overrides (values in TOML syntax), read by
    the trainer's loader (training/config.py, `apply_toml`)."""
    cfg = SimConfig()
    try:
        if path is not None:
            apply_toml(cfg, read_toml(path), str(path))
        apply_toml(cfg, parse_overrides(overrides), "--set")
    except ConfigError as e:
        raise SimConfigError(str(e)) from None
    cfg.failures.kinds = _kinds("failures.kinds", cfg.failures.kinds)
    return validate(cfg)


def with_(cfg: SimConfig, **changes) -> SimConfig:
    """A copy with `section_key=value` changes, e.g. with_(cfg, job_gpus=8192)."""
    for name, value in changes.items():
        sec, _, key = name.partition("_")
        cfg = replace(cfg, **{sec: replace(getattr(cfg, sec), **{key: value})})
    return cfg
