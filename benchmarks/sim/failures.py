"""The failure process: Poisson failures per server (or per GPU), each of one kind.

Failures arrive in wall-clock time, whether the job is stepping or recovering:
a server can fail while the job waits for another one to be replaced. Units are
spread over the replica groups as evenly as possible; a failure's group is the
group of the unit that failed. Drawn once per seed and shared by every mode, so
synchronous and FT-HSDP runs of one seed see the same failures.
"""

from dataclasses import dataclass

import numpy as np

from benchmarks.sim.config import SimConfig


@dataclass
class Failures:
    t: np.ndarray  # failure times (s), sorted
    group: np.ndarray  # replica group of the failed unit
    kind: np.ndarray  # index into cfg.failures.kinds
    detect: np.ndarray  # detection time (s) of each failure, synchronous job
    ft_detect: np.ndarray  # the same under FT-HSDP
    weights: np.ndarray  # share of the job's GPUs in each replica group
    horizon: float  # simulated wall-clock time (s)


def units(cfg: SimConfig) -> int:
    j = cfg.job
    return j.gpus // j.gpus_per_server if cfg.failures.unit == "server" else j.gpus


def job_mtbf_s(cfg: SimConfig) -> float:
    """Mean time between failures of the whole job (inf without failures)."""
    h = cfg.failures.unit_mtbf_h
    return float("inf") if h == 0 else h * 3600.0 / units(cfg)


def draw(cfg: SimConfig, seed: int) -> Failures:
    n_units, r = units(cfg), cfg.job.replica_groups
    horizon = cfg.job.days * 86400.0
    rng = np.random.default_rng(seed)
    mtbf = job_mtbf_s(cfg)
    n = 0 if mtbf == float("inf") else int(rng.poisson(horizon / mtbf))
    t = np.sort(rng.uniform(0.0, horizon, n))
    unit = rng.integers(0, n_units, n)
    kinds = cfg.failures.kinds
    share = np.array([k.share for k in kinds], float)
    kind = rng.choice(len(kinds), size=n, p=share / share.sum())
    detect = np.array([k.detect_s for k in kinds], float)[kind]
    ft_detect = np.array([k.detect_s if k.ft_detect_s < 0 else k.ft_detect_s for k in kinds], float)[kind]
    # group g holds units [first[g], first[g] + sizes[g]): sizes differ by at most one unit
    sizes = np.full(r, n_units // r, np.int64)
    sizes[: n_units % r] += 1
    first = np.cumsum(sizes) - sizes
    group = np.searchsorted(first, unit, side="right") - 1
    return Failures(
        t=t, group=group, kind=kind, detect=detect, ft_detect=ft_detect, weights=sizes / n_units, horizon=horizon
    )
