"""Balancing (FreeScale technique 1): assign each training sample to a (step, rank) so that, at
every synchronous step, the slowest rank waits as little as possible.

One epoch: shuffle with the seed, cut into windows of K steps, sort each window by cost into
steps of similar cost, partition each step over the W ranks (LPT, and Karmarkar-Karp where
cheap, the better kept), shuffle the steps inside the window. Every rank gets >= 1 sample in
every step. Why and the knobs: docs/dataprep.md.
"""

import heapq
from dataclasses import dataclass

import numpy as np

from dataprep.errors import DataprepError

# Chosen from `python benchmarks/dataprep_bench.py` (see BENCHMARKS.md, "## dataprep"):
# the smallest K that removes >= 90% of the bubble on heavy-tailed data at W=8..256.
DEFAULT_WINDOW_STEPS = 64
TAILS = ("fill", "drop")
METHODS = ("auto", "lpt", "kk")
# auto: KK (pure-Python merges, ~items*W work) runs only on steps where LPT ends more than
# KK_MIN_GAP above the lower bound, items * W <= KK_MAX_WORK, and in total at most KK_BUDGET
# work per plan (deterministic: a work count, not a clock)
KK_MIN_GAP = 1e-3
KK_MAX_WORK = 50_000
KK_BUDGET = 250_000


@dataclass
class Plan:
    """Where every sample goes. step/rank are -1 for samples dropped with the tail."""

    step: np.ndarray  # int32 [N]
    rank: np.ndarray  # int32 [N]
    steps: int
    world_size: int
    batch_size: int
    window_steps: int
    tail: str
    dropped: int  # samples not in this epoch (tail "drop")
    filled: int  # leftover samples spread over the steps (tail "fill")


def _step_sizes(n: int, world_size: int, batch_size: int, tail: str) -> np.ndarray:
    g = world_size * batch_size
    if n < world_size:
        raise DataprepError(
            f"--world-size {world_size} is larger than the data allows: only {n} training samples, "
            f"and every rank needs at least one per step; use --world-size <= {n}"
        )
    if tail == "drop":
        s = n // g
        if s == 0:
            raise DataprepError(
                f"{n} training samples are fewer than one global batch (--world-size {world_size} x "
                f"--batch-size {batch_size} = {g}); lower --batch-size or use --tail fill"
            )
        return np.full(s, g, np.int64)
    s = max(1, n // g)
    # spread the leftover in whole multiples of W (so equal-cost samples still split evenly);
    # only one step gets the last n mod W samples
    per_rank, rest = divmod(n, s * world_size)
    sizes = np.full(s, per_rank * world_size, np.int64)
    sizes[: rest // world_size] += world_size
    sizes[rest // world_size if rest // world_size < s else 0] += rest % world_size
    return sizes


def lpt(costs: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy LPT on many steps at once.

    costs: [S, M] per step, sorted descending, zero-padded. Returns (rank [S, M], loads [S, W]).
    Each item goes to the currently least-loaded rank of its step (ties: lowest rank).
    """
    s, m = costs.shape
    loads = np.zeros((s, world_size))
    rank = np.zeros((s, m), np.int32)
    rows = np.arange(s)
    w = min(world_size, m)
    rank[:, :w] = np.arange(w)  # the W largest items open the W ranks
    loads[:, :w] = costs[:, :w]
    for j in range(w, m):
        r = loads.argmin(axis=1)
        rank[:, j] = r
        loads[rows, r] += costs[:, j]
    return rank, loads


def karmarkar_karp(costs: np.ndarray, world_size: int) -> np.ndarray | None:
    """Multi-way largest differencing (Karmarkar-Karp). Returns the rank of each item,
    or None when some rank would stay empty."""
    n = len(costs)
    heap = []
    for i in range(n):
        loads = np.zeros(world_size)
        loads[0] = costs[i]
        groups = [[i]] + [[] for _ in range(world_size - 1)]
        heap.append((-float(costs[i]), i, loads, groups))
    heapq.heapify(heap)
    tie = n
    while len(heap) > 1:
        _, _, la, ga = heapq.heappop(heap)
        _, _, lb, gb = heapq.heappop(heap)
        # largest bucket of one with the smallest of the other (both kept sorted descending)
        loads = la + lb[::-1]
        groups = [ga[k] + gb[world_size - 1 - k] for k in range(world_size)]
        order = np.argsort(-loads, kind="stable")
        loads = loads[order]
        groups = [groups[k] for k in order]
        heapq.heappush(heap, (-(loads[0] - loads[-1]), tie, loads, groups))
        tie += 1
    groups = heap[0][3]
    if any(not g for g in groups):
        return None
    rank = np.empty(n, np.int32)
    for r, g in enumerate(groups):
        rank[g] = r
    return rank


def _windows(sizes: np.ndarray, k: int):
    """(first step, last step + 1) of each window of k steps."""
    for a in range(0, len(sizes), k):
        yield a, min(a + k, len(sizes))


def _window_steps(world_size: int, batch_size: int, tail: str, method: str, window_steps: int | None) -> int:
    """The settings checked; returns K, the steps per cost-sorted window."""
    if world_size < 1:
        raise DataprepError(f"--world-size {world_size}: must be >= 1")
    if batch_size < 1:
        raise DataprepError(f"--batch-size {batch_size}: must be >= 1 (samples per rank per step)")
    if tail not in TAILS:
        raise DataprepError(f"--tail {tail!r}: choose one of {', '.join(TAILS)}")
    if method not in METHODS:
        raise DataprepError(f"--method {method!r}: choose one of {', '.join(METHODS)}")
    k = DEFAULT_WINDOW_STEPS if window_steps is None else int(window_steps)
    if k < 1:
        raise DataprepError(f"--window-steps {k}: must be >= 1 (1 = no grouping by cost)")
    return k


def _cost_sorted(cost: np.ndarray, perm: np.ndarray, sizes: np.ndarray, starts: np.ndarray, k: int) -> np.ndarray:
    """The shuffled samples kept for the epoch, each window of k steps sorted by cost descending:
    step j's samples are ordered[starts[j]:starts[j+1]] (in epoch order, before the step shuffle)."""
    ordered = perm[: starts[-1]].copy()
    for a, b in _windows(sizes, k):
        seg = ordered[starts[a] : starts[b]]
        ordered[starts[a] : starts[b]] = seg[np.argsort(-cost[seg], kind="stable")]
    return ordered


def _refine_kk(grid: np.ndarray, sizes: np.ndarray, rank_grid: np.ndarray, loads: np.ndarray, method: str) -> None:
    """Karmarkar-Karp on the steps LPT left furthest above the lower bound (auto: within the work
    limits), worst first; a step takes KK's ranks where its largest rank cost is lower."""
    world_size = loads.shape[1]
    lower = np.maximum(loads.sum(1) / world_size, grid[:, 0])
    gap = loads.max(1) / lower - 1
    budget = KK_BUDGET
    for j in np.argsort(-gap, kind="stable"):  # worst steps first
        work = int(sizes[j]) * world_size
        if method == "auto" and (gap[j] <= KK_MIN_GAP or work > KK_MAX_WORK or work > budget):
            continue
        budget -= work
        r = karmarkar_karp(grid[j, : sizes[j]], world_size)
        if r is not None:
            kl = np.bincount(r, weights=grid[j, : sizes[j]], minlength=world_size)
            if kl.max() < loads[j].max():
                rank_grid[j, : sizes[j]] = r
                loads[j] = kl


def plan(
    cost: np.ndarray,
    *,
    world_size: int,
    batch_size: int,
    window_steps: int | None = None,
    seed: int = 0,
    tail: str = "fill",
    method: str = "auto",
) -> Plan:
    """Balanced assignment of samples (by cost) to steps and ranks; see the module doc."""
    k = _window_steps(world_size, batch_size, tail, method, window_steps)
    cost = np.asarray(cost, dtype=np.float64)
    n = len(cost)
    sizes = _step_sizes(n, world_size, batch_size, tail)
    s = len(sizes)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    starts = np.zeros(s + 1, np.int64)
    np.cumsum(sizes, out=starts[1:])
    ordered = _cost_sorted(cost, perm, sizes, starts, k)
    # within a step the samples are now sorted by cost descending (a window's sort is)
    pos = np.arange(starts[-1]) - np.repeat(starts[:-1], sizes)
    stp = np.repeat(np.arange(s), sizes)
    grid = np.zeros((s, int(sizes.max())))
    grid[stp, pos] = cost[ordered]
    rank_grid, loads = lpt(grid, world_size)
    if method in ("auto", "kk"):
        _refine_kk(grid, sizes, rank_grid, loads, method)
    # shuffle the step order inside each window
    step_id = np.empty(s, np.int64)
    for a, b in _windows(sizes, k):
        step_id[a:b] = a + rng.permutation(b - a)
    out_step = np.full(n, -1, np.int32)
    out_rank = np.full(n, -1, np.int32)
    out_step[ordered] = step_id[stp]
    out_rank[ordered] = rank_grid[stp, pos]
    return Plan(
        step=out_step,
        rank=out_rank,
        steps=s,
        world_size=world_size,
        batch_size=batch_size,
        window_steps=k,
        tail=tail,
        dropped=n - int(starts[-1]),
        filled=int(n - s * world_size * batch_size) if tail == "fill" else 0,
    )


def random_plan(cost: np.ndarray, *, world_size: int, batch_size: int, seed: int = 0, tail: str = "fill") -> Plan:
    """Baseline without balancing: shuffled samples cut into steps, each step cut into W
    equal-count rank slices (what a plain distributed sampler does)."""
    n = len(cost)
    sizes = _step_sizes(n, world_size, batch_size, tail)
    s = len(sizes)
    perm = np.random.default_rng(seed).permutation(n)
    starts = np.zeros(s + 1, np.int64)
    np.cumsum(sizes, out=starts[1:])
    pos = np.arange(starts[-1]) - np.repeat(starts[:-1], sizes)
    stp = np.repeat(np.arange(s), sizes)
    out_step = np.full(n, -1, np.int32)
    out_rank = np.full(n, -1, np.int32)
    out_step[perm[: starts[-1]]] = stp
    out_rank[perm[: starts[-1]]] = (pos * world_size // sizes[stp]).astype(np.int32)
    return Plan(
        step=out_step,
        rank=out_rank,
        steps=s,
        world_size=world_size,
        batch_size=batch_size,
        window_steps=1,
        tail=tail,
        dropped=n - int(starts[-1]),
        filled=int(n - s * world_size * batch_size) if tail == "fill" else 0,
    )


def rank_loads(p: Plan, cost: np.ndarray) -> np.ndarray:
    """[steps, W] total cost per rank per step."""
    keep = p.step >= 0
    flat = p.step[keep].astype(np.int64) * p.world_size + p.rank[keep]
    return np.bincount(flat, weights=cost[keep], minlength=p.steps * p.world_size).reshape(p.steps, p.world_size)


def stats(p: Plan, cost: np.ndarray) -> dict:
    """Per-step imbalance (max/mean rank cost), bubble fraction, and the distance of each
    step's max from its lower bound max(mean, largest sample)."""
    loads = rank_loads(p, cost)
    keep = p.step >= 0
    largest = np.zeros(p.steps)
    np.maximum.at(largest, p.step[keep], cost[keep])
    mean = loads.mean(1)
    mx = loads.max(1)
    lower = np.maximum(mean, largest)
    imb = mx / mean
    over = mx / lower - 1
    q = lambda a, x: float(np.quantile(a, x))  # noqa: E731
    return {
        "imbalance": {"p50": q(imb, 0.5), "p99": q(imb, 0.99), "max": float(imb.max()), "mean": float(imb.mean())},
        "over_lower_bound": {"p50": q(over, 0.5), "p99": q(over, 0.99), "max": float(over.max())},
        "bubble_fraction": float(1 - loads.sum() / (p.world_size * mx.sum())),
        "bubble_fraction_lower_bound": float(1 - loads.sum() / (p.world_size * lower.sum())),
    }
