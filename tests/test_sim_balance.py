"""Bubbles at W ranks (benchmarks.sim.balance): random vs per-step LPT vs window-balanced,
partitioned by dataprep's own LPT and costed by dataprep's cost model (one source of truth)."""

import numpy as np
import pytest

from benchmarks.sim import balance as sim_balance
from benchmarks.sim.balance import (
    LengthsError,
    bubble_fraction,
    bubbles,
    dataset_lengths,
    default_cost,
    lengths_source,
    partition,
)
from dataprep import balance as dataprep_balance
from dataprep.cost import DEFAULT

DEFAULT_COST = default_cost()


def test_bubble_fraction_definition():
    assert bubble_fraction(np.ones((3, 4))) == 0.0
    loads = np.array([[1.0, 3.0], [2.0, 2.0]])  # step 1 waits 2 units on rank 0
    assert bubble_fraction(loads) == pytest.approx(1 - 8 / (2 * (3 + 2)))


def test_the_model_uses_dataprep_balancer_and_default_cost_model():
    assert DEFAULT_COST == {"a": DEFAULT.a, "b": DEFAULT.b, "c0": DEFAULT.c0}
    assert sim_balance.lpt is dataprep_balance.lpt  # imported, not re-implemented
    assert not hasattr(sim_balance, "DEFAULT_COST") and not hasattr(sim_balance, "lpt_rounds")
    rng = np.random.default_rng(3)
    costs = -np.sort(-DEFAULT(rng.integers(1, 500, (4, 16 * 8))), axis=1)
    assert np.array_equal(partition(costs, 16), dataprep_balance.lpt(costs, 16)[1])


def test_partition_conserves_work_and_balances():
    rng = np.random.default_rng(0)
    costs = -np.sort(-rng.lognormal(0, 1, (5, 64 * 8)), axis=1)
    loads = partition(costs, 64)
    assert loads.shape == (5, 64)
    assert np.allclose(loads.sum(1), costs.sum(1))
    # list-scheduling bound: the busiest rank holds at most the mean plus the largest item
    assert (loads.max(1) <= costs.sum(1) / 64 + costs[:, 0] + 1e-9).all()
    # without a heavy tail the partition is nearly perfect, far better than random
    even = -np.sort(-rng.uniform(1, 2, (5, 64 * 8)), axis=1)
    random_loads = rng.permuted(even, axis=1).reshape(5, 64, 8).sum(2)
    assert bubble_fraction(partition(even, 64)) < 0.02 < 0.1 < bubble_fraction(random_loads)
    # equal items divide evenly
    assert bubble_fraction(partition(np.ones((2, 40)), 8)) == 0.0


@pytest.mark.parametrize("w", [8, 256])
def test_balanced_beats_per_step_beats_random_on_heavy_tails(w):
    r = bubbles(w, batch=16, window=8, windows=2, cost=DEFAULT_COST, rng=np.random.default_rng(1))
    assert r["balanced"] < r["per_step_lpt"] < r["random"]
    assert r["balanced"] < 0.1 * r["random"]


def test_random_bubble_grows_with_world_size():
    rng = np.random.default_rng(2)
    b = [bubbles(w, batch=16, window=4, windows=1, cost=DEFAULT_COST, rng=rng)["random"] for w in (8, 64, 512)]
    assert b == sorted(b)


def test_uniform_lengths_have_no_bubble_when_balanced():
    r = bubbles(16, batch=8, window=4, windows=1, cost={"a": 0.0, "b": 0.0, "c0": 1.0}, rng=np.random.default_rng(0))
    assert r == {"random": 0.0, "per_step_lpt": 0.0, "balanced": 0.0}


def test_shared_dataset_lengths(shared_data):
    beauty = dataset_lengths(shared_data / "beauty.txt", 50)
    video = dataset_lengths(shared_data / "video.txt", 50)
    assert len(beauty) == 22_363 and beauty.min() >= 2 and beauty.max() == 50  # min 5 items per user
    assert 30_000 < len(video) <= 31_013 and video.max() == 50
    src = lengths_source("video", shared_data, 200)
    r = bubbles(64, batch=16, window=8, windows=1, cost=DEFAULT_COST, rng=np.random.default_rng(0), source=src)
    assert r["balanced"] < r["random"]


def test_lengths_source_errors(tmp_path):
    with pytest.raises(LengthsError, match="not found"):
        lengths_source(str(tmp_path / "nope.txt"), tmp_path, 50)
    bad = tmp_path / "bad.txt"
    bad.write_text("3\nx\n")
    with pytest.raises(LengthsError, match="one integer length per line"):
        lengths_source(str(bad), tmp_path, 50)
    good = tmp_path / "good.txt"
    good.write_text("3\n700\n0\n")
    assert lengths_source(str(good), tmp_path, 50).tolist() == [3, 50]
