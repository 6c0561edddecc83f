"""Per-step bubbles at W data-parallel ranks: random vs length-balanced assignment.

A synchronous step lasts as long as its slowest rank; the bubble fraction of a run
is 1 - (total work) / (W * sum over steps of the slowest rank's work). Sample cost
is dataprep's cost model c(L) = a L^2 + b L + c0 of history length L (`CostModel`;
its `DEFAULT` when no calibration is found).

- random: shuffled samples, B per rank per step (a plain distributed sampler);
- per-step LPT: each random step's W*B samples partitioned over the W ranks;
- balanced (FreeScale-style, as dataprep builds shards): windows of K steps, samples
  sorted by cost inside a window and cut into steps, then each step partitioned.

The partition is dataprep's own (`dataprep.balance.lpt`: greedy LPT, vectorized over
steps), so the model's balancing is the one the shards get; no copy of it lives here.
"""

from pathlib import Path

import numpy as np

from dataprep.balance import lpt
from dataprep.cost import DEFAULT, CostModel

SHARED = ("beauty", "video")


def default_cost() -> dict:
    """dataprep's default cost model as {a, b, c0} (microseconds per sample)."""
    return {"a": DEFAULT.a, "b": DEFAULT.b, "c0": DEFAULT.c0}


class LengthsError(ValueError):
    pass


def dataset_lengths(path: Path, max_len: int) -> np.ndarray:
    """Input-history lengths of the training samples of a shared dataset: per user,
    the training sequence (all but the last two items) minus the next-item target,
    capped at max_len. beauty.txt: one user per line; video.txt: `user item` pairs."""
    text = Path(path).read_text()
    if path.name.startswith("beauty"):
        n = np.array([line.count(" ") for line in text.splitlines() if line.strip()], np.int64)  # items per user
    else:
        users = np.array(text.split(), np.int64)[0::2]
        n = np.unique(users, return_counts=True)[1]
    lengths = np.minimum(n - 3, max_len)
    lengths = lengths[lengths >= 1]
    if not len(lengths):
        raise LengthsError(f"{path}: no user with at least 4 items")
    return lengths


def lengths_source(spec: str, shared_dir: Path, max_len: int):
    """An array of lengths to resample from, or None for the synthetic lognormal."""
    if spec == "lognormal":
        return None
    path = shared_dir / f"{spec}.txt" if spec in SHARED else Path(spec)
    if not path.exists():
        raise LengthsError(f'balance.lengths = {spec!r}: {path} not found; use "lognormal" or a path')
    if spec in SHARED:
        return dataset_lengths(path, max_len)
    try:
        lengths = np.loadtxt(path, dtype=np.int64, ndmin=1)
    except ValueError as e:
        raise LengthsError(f"{path}: expected one integer length per line ({e})") from None
    return np.minimum(lengths[lengths >= 1], max_len)


def sample_lengths(rng, n: int, source, median: float, sigma: float, max_len: int) -> np.ndarray:
    if source is None:
        x = rng.lognormal(np.log(median), sigma, n)
        return np.clip(np.rint(x), 1, max_len)
    return rng.choice(source, n).astype(np.float64)


def partition(costs: np.ndarray, world_size: int) -> np.ndarray:
    """costs [S, W*B], each row sorted descending -> per-rank loads [S, W], by dataprep's LPT."""
    return lpt(costs, world_size)[1]


def bubble_fraction(loads: np.ndarray) -> float:
    """1 - total work / (W * sum over steps of the slowest rank's work)."""
    return float(1.0 - loads.sum() / (loads.shape[1] * loads.max(axis=1).sum()))


def bubbles(
    world_size: int,
    *,
    batch: int,
    window: int,
    windows: int,
    cost: dict,
    rng,
    source=None,
    median=40.0,
    sigma=1.2,
    max_len=1024,
) -> dict:
    """Bubble fractions of random, per-step LPT and window-balanced steps at W ranks."""
    steps, per_step = window * windows, world_size * batch
    L = sample_lengths(rng, steps * per_step, source, median, sigma, max_len)
    c = CostModel(cost["a"], cost["b"], cost["c0"])(L)
    rand = c.reshape(steps, world_size, batch).sum(axis=2)
    per_step_lpt = partition(-np.sort(-c.reshape(steps, per_step), axis=1), world_size)
    win = -np.sort(-c.reshape(windows, window * per_step), axis=1)  # sort inside each window
    balanced = partition(win.reshape(steps, per_step), world_size)  # consecutive cuts = steps
    return {
        "random": bubble_fraction(rand),
        "per_step_lpt": bubble_fraction(per_step_lpt),
        "balanced": bubble_fraction(balanced),
    }
