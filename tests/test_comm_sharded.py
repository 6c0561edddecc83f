"""Sharded embeddings on 2 real gloo ranks are bitwise equal to an unsharded table:
forward rows, and gradients equal to the unsharded per-rank grads summed by all-reduce."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.spawn import run_ranks
from training.comm.sharded_embedding import (
    ShardedEmbedding,
    gather_full_weight,
    reference_weight,
)
from training.comm.transport import make_transport

pytestmark = pytest.mark.integ

N, D = 103, 8  # N not divisible by K: the last shard is short


def _batches(rank):
    g = torch.Generator().manual_seed(10 + rank)
    zipf = torch.distributions.Categorical(probs=1.0 / torch.arange(1, N + 1).double())
    yield zipf.sample((4, 13)) if rank == 0 else torch.randint(0, N, (5, 11), generator=g)  # dup-heavy
    yield torch.randint(0, N // 2, (17,), generator=g)  # every id on rank 0: a zero split
    yield torch.tensor([0, 0, N - 1, 5], dtype=torch.int64)  # padding ids included
    yield torch.zeros(0, dtype=torch.int64)  # an empty lookup on one step


def _equal_all(rank, world_size, kinds):
    return [_equal(rank, world_size, kind) for kind in kinds]


def _equal(rank, world_size, kind):
    torch.manual_seed(0)
    t = make_transport(kind)
    ref_w = reference_weight(N, D, seed=7, padding_idx=0)
    emb = ShardedEmbedding(N, D, t, seed=7, padding_idx=0)
    lo, hi = emb.row_range
    assert torch.equal(emb.weight.detach(), ref_w[lo:hi])
    fails, nonzero_steps = [], 0
    for step, ids in enumerate(_batches(rank)):
        if step == 3 and rank == 1:
            ids = torch.randint(0, N, (9,))
        up = torch.randn(*ids.shape, D, generator=torch.Generator().manual_seed(100 * step + rank))
        ref = torch.nn.Parameter(ref_w.clone())
        out_ref = F.embedding(ids, ref, padding_idx=0)
        (out_ref * up).sum().backward()
        dist.all_reduce(ref.grad)  # unsharded data parallelism: replicated table, summed grads
        emb.weight.grad = None
        out = emb(ids)
        (out * up).sum().backward()
        if not torch.equal(out, out_ref):
            fails.append(f"step {step}: forward differs")
        if not torch.equal(emb.weight.grad, ref.grad[lo:hi]):
            fails.append(f"step {step}: grad differs by {(emb.weight.grad - ref.grad[lo:hi]).abs().max()}")
        nonzero_steps += int(emb.weight.grad.abs().sum() > 0)
    full = gather_full_weight(emb)
    t.close()
    if hi > lo and nonzero_steps < 2:
        fails.append("gradients reached the shard in fewer than 2 steps: the test checks nothing")
    return fails, torch.equal(full, ref_w)


CASES = ["collective", "smfree"]  # transports


def _everything(rank, world_size):
    return {
        "equal": _equal_all(rank, world_size, CASES),
        "bad_ids": _bad_ids(rank, world_size),
    }


@pytest.fixture(scope="module")
def ranks():
    """Every check of this file in one pair of gloo processes (process start-up dominates)."""
    return run_ranks(_everything, 2, timeout_s=150)


def test_sharded_equals_unsharded(ranks):
    for r in ranks:
        for case, (fails, full_ok) in zip(CASES, r["equal"], strict=True):
            assert fails == [], case
            assert full_ok, case


def _bad_ids(rank, world_size):
    emb = ShardedEmbedding(10, 2, make_transport("collective"))
    try:
        emb.plan(torch.tensor([3, 10]))
    except IndexError as e:
        return str(e)


def test_out_of_range_ids_are_a_clear_error(ranks):
    msgs = [r["bad_ids"] for r in ranks]
    assert all("[0, 10)" in m and "num_items" in m for m in msgs)
