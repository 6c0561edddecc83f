"""The trainer's sharded item table on 2 real gloo ranks: lookups submitted ahead of the model
(training/comm/item_table.py) return exactly the rows of an inline lookup, under every policy;
the next batch's id exchange is reused when that batch comes and discarded when another does
(a retried or make-up step); the issue order follows the policy and is the same on every rank."""

import pytest
import torch
import torch.distributed as dist

from benchmarks.spawn import run_ranks
from training.comm.item_table import ShardedItemTable
from training.comm.scheduler import CommScheduler
from training.comm.sharded_embedding import reference_weight
from training.comm.transport import make_transport

pytestmark = pytest.mark.integ

N, D = 61, 4
KEYS = [0, 1, 1, 4, 5]  # the batch each step trains; the loop always expects key + 1 next
# step 1: hit (0 expected 1); step 2: a retry of 1, miss; step 3: 4 after expecting 2, miss; step 4: hit


def _ids(rank: int, key: int) -> list[torch.Tensor]:
    """This rank's [histories, targets, negatives] of batch `key` (different per rank)."""
    g = torch.Generator().manual_seed(1000 * key + rank)
    n = 6 + key + 3 * rank
    return [
        torch.randint(0, N, (n,), generator=g),
        torch.randint(1, N, (n,), generator=g),
        torch.randint(1, N, (5,), generator=g),
    ]


def _run(rank, world_size, policy):
    full = reference_weight(N, D, seed=3, padding_idx=0)
    sched = CommScheduler(policy)
    table = ShardedItemTable(full, make_transport("collective", group=dist.new_group()), sched)
    oracle = ShardedItemTable(full, make_transport("collective", group=dist.new_group()))  # inline lookups
    fails = []
    for step, key in enumerate(KEYS):
        sched.step = step
        ids = _ids(rank, key)
        nxt = _ids(rank, key + 1)[:2]
        table.start_step(key, ids, key + 1, nxt)
        for name, t in zip(("history", "candidate", "negative"), ids, strict=True):
            if not torch.equal(table(t), oracle(t)):
                fails.append(f"step {step}: {name} rows differ from an inline lookup")
    order = [r["name"] for r in sched.records(step=len(KEYS) - 1)]
    counts = (table.prefetch_hits, table.prefetch_misses)
    try:  # the model asking for other ids than were submitted is an error, not wrong rows
        table.start_step(9, _ids(rank, 9))
        table(_ids(rank, 8)[0])
        fails.append("a lookup of other ids than submitted was served")
    except RuntimeError as e:
        if "other ids than start_step() submitted" not in str(e):
            fails.append(f"unexpected error: {e}")
    sched.drain()
    sched.close()
    return fails, *counts, order


@pytest.mark.parametrize("policy", ["blocking", "overlapped", "prioritized"])
def test_lookups_ahead_equal_inline_and_prefetch_hits_and_misses(policy):
    results = run_ranks(_run, 2, policy, timeout_s=120)
    for fails, hits, misses, _ in results:
        assert fails == []
        assert (hits, misses) == (2, 2)
    orders = [r[3] for r in results]
    assert orders[0] == orders[1], "the ranks issued their collectives in different orders"
    this_step = ["history_rows", "candidate_rows", "negative_ids", "negative_rows"]  # a hit: no history/candidate ids
    next_ids = ["next_history_ids", "next_candidate_ids"]
    if policy == "prioritized":  # in the order compute needs them; the next batch last
        assert orders[0] == this_step + next_ids
    else:  # in submission order: the next batch's ids were submitted first
        assert orders[0] == next_ids + this_step
