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
from dataprep.settings import check_choice

# Chosen from `python benchmarks/dataprep_bench.py` (see BENCHMARKS.md, "## dataprep"):
# the smallest K that removes >= 90% of the bubble on heavy-tailed data at W=8..256.
DEFAULT_WINDOW_STEPS = 64
# auto: KK (pure-Python merges, ~items*W work) runs only on steps where LPT ends more than
# KK_MIN_GAP above the lower bound, items * W <= KK_MAX_WORK, and in total at most KK_BUDGET
# work per plan (deterministic: a work count, not a clock)
KK_MIN_GAP = 1e-3
KK_MAX_WORK = 50_000
KK_BUDGET = 250_000
# samples per block of windows the plan works on at once (bounds its scratch memory)
BLOCK_SAMPLES = 1 << 20


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
    check_choice("tail", tail)
    check_choice("method", method)
    k = DEFAULT_WINDOW_STEPS if window_steps is None else int(window_steps)
    if k < 1:
        raise DataprepError(f"--window-steps {k}: must be >= 1 (1 = no grouping by cost)")
    return k


def _kept_order(rng: np.random.Generator, n: int, kept: int) -> np.ndarray:
    """The epoch's shuffled samples, the first `kept` of them, as int32 where the ids fit."""
    return rng.permutation(n)[:kept].astype(np.int32 if n < 2**31 else np.int64)


def _blocks(sizes: np.ndarray, k: int):
    """Runs of whole windows of k steps, each of about BLOCK_SAMPLES samples (at least one window):
    the plan works a block at a time, so its scratch memory does not grow with the epoch."""
    a = 0
    windows = max(1, BLOCK_SAMPLES // (int(sizes.max()) * k))
    while a < len(sizes):
        b = min(a + windows * k, len(sizes))
        yield a, b
        a = b


def _grid(cost: np.ndarray, seg: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The costs of consecutive steps as rows [steps, max size], zero-padded, and each sample's
    (row, column) in it."""
    starts = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    row = np.repeat(np.arange(len(sizes)), sizes)
    col = np.arange(len(seg)) - starts[row]
    grid = np.zeros((len(sizes), int(sizes.max())))
    grid[row, col] = cost[seg]
    return grid, row, col


def _refine_kk(
    cost: np.ndarray,
    ordered: np.ndarray,
    starts: np.ndarray,
    sizes: np.ndarray,
    largest: np.ndarray,
    out_rank: np.ndarray,
    loads: np.ndarray,
    method: str,
) -> None:
    """Karmarkar-Karp on the steps LPT left furthest above the lower bound (auto: within the work
    limits), worst first; a step takes KK's ranks where its largest rank cost is lower."""
    world_size = loads.shape[1]
    lower = np.maximum(loads.sum(1) / world_size, largest)
    gap = loads.max(1) / lower - 1
    budget = KK_BUDGET
    for j in np.argsort(-gap, kind="stable"):  # worst steps first
        work = int(sizes[j]) * world_size
        if method == "auto" and (gap[j] <= KK_MIN_GAP or work > KK_MAX_WORK or work > budget):
            continue
        budget -= work
        seg = ordered[starts[j] : starts[j + 1]]
        r = karmarkar_karp(cost[seg], world_size)
        if r is not None:
            kl = np.bincount(r, weights=cost[seg], minlength=world_size)
            if kl.max() < loads[j].max():
                out_rank[seg] = r
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
    """Balanced assignment of samples (by cost) to steps and ranks; see the module doc.
    Memory: the costs and ~12 bytes per sample, plus one block's scratch."""
    k = _window_steps(world_size, batch_size, tail, method, window_steps)
    cost = np.asarray(cost, dtype=np.float64)
    n = len(cost)
    sizes = _step_sizes(n, world_size, batch_size, tail)
    s = len(sizes)
    rng = np.random.default_rng(seed)
    starts = np.zeros(s + 1, np.int64)
    np.cumsum(sizes, out=starts[1:])
    # the shuffled samples kept for the epoch; each window sorted by cost descending below, so
    # step j's samples are ordered[starts[j]:starts[j+1]], largest first
    ordered = _kept_order(rng, n, starts[-1])
    out_rank = np.full(n, -1, np.int32)
    loads = np.zeros((s, world_size))
    for a, b in _windows(sizes, k):
        seg = ordered[starts[a] : starts[b]]
        seg[:] = seg[np.argsort(-cost[seg], kind="stable")]
    for a, b in _blocks(sizes, k):
        seg = ordered[starts[a] : starts[b]]
        grid, row, col = _grid(cost, seg, sizes[a:b])
        rank_grid, loads[a:b] = lpt(grid, world_size)
        out_rank[seg] = rank_grid[row, col]
    if method in ("auto", "kk"):
        _refine_kk(cost, ordered, starts, sizes, cost[ordered[starts[:-1]]], out_rank, loads, method)
    # shuffle the step order inside each window
    out_step = np.full(n, -1, np.int32)
    for a, b in _windows(sizes, k):
        step_id = a + rng.permutation(b - a)
        out_step[ordered[starts[a] : starts[b]]] = np.repeat(step_id, sizes[a:b])
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
    starts = np.zeros(s + 1, np.int64)
    np.cumsum(sizes, out=starts[1:])
    perm = _kept_order(np.random.default_rng(seed), n, starts[-1])
    out_step = np.full(n, -1, np.int32)
    out_rank = np.full(n, -1, np.int32)
    for a, b in _blocks(sizes, 1):
        seg = perm[starts[a] : starts[b]]
        row = np.repeat(np.arange(b - a), sizes[a:b])
        col = np.arange(len(seg)) - (starts[a:b] - starts[a])[row]
        out_step[seg] = a + row
        out_rank[seg] = col * world_size // sizes[a:b][row]
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


def _kept_chunks(p: Plan, cost: np.ndarray):
    """(step, rank, cost) of the kept samples, BLOCK_SAMPLES samples at a time."""
    for lo in range(0, len(cost), BLOCK_SAMPLES):
        step = p.step[lo : lo + BLOCK_SAMPLES]
        keep = step >= 0
        yield step[keep], p.rank[lo : lo + BLOCK_SAMPLES][keep], cost[lo : lo + BLOCK_SAMPLES][keep]


def rank_loads(p: Plan, cost: np.ndarray) -> np.ndarray:
    """[steps, W] total cost per rank per step (summed in sample order, a chunk at a time)."""
    loads = np.zeros(p.steps * p.world_size)
    for step, rank, c in _kept_chunks(p, cost):
        np.add.at(loads, step.astype(np.int64) * p.world_size + rank, c)
    return loads.reshape(p.steps, p.world_size)


def stats(p: Plan, cost: np.ndarray) -> dict:
    """Per-step imbalance (max/mean rank cost), bubble fraction, and the distance of each
    step's max from its lower bound max(mean, largest sample)."""
    loads = rank_loads(p, cost)
    largest = np.zeros(p.steps)
    for step, _, c in _kept_chunks(p, cost):
        np.maximum.at(largest, step, c)
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
