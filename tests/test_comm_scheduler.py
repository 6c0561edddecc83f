"""The comm scheduler and the trainer's sharded item table (ShardedItemTable, stepped by the
comm benchmark's model) on 2 real gloo ranks: consumers never start before their op
finished, issue order follows priority and is the same on every rank, and the pipelined,
prioritized step computes exactly what the blocking step computes."""

import threading
import time
from dataclasses import asdict

import pytest
import torch

from benchmarks.comm_bench import RunConfig, run_interleaved
from benchmarks.spawn import run_ranks
from training.comm.scheduler import CommScheduler, Stage

pytestmark = pytest.mark.integ

SMALL = dict(steps=4, warmup=1, num_items=500, dim=16, d_model=16, batch=3, max_len=12, num_neg=32)


def test_prioritized_issue_order_and_waits_in_process():
    """Ops submitted in a scrambled order are issued by stage; each wait returns only after
    its op ended; the slow first op delays the rest (one ordered queue)."""
    s = CommScheduler("prioritized")
    running = []
    lock = threading.Lock()

    def fn(name, dt):
        def run():
            with lock:
                running.append(name)
                assert len(running) == 1, "two ops ran at once"
            time.sleep(dt)
            with lock:
                running.remove(name)
            return name

        return run

    order = [
        ("next", Stage.NEXT_INPUT),
        ("neg", Stage.NEGATIVE),
        ("hist", Stage.HISTORY),
        ("cand", Stage.CANDIDATE),
        ("grad", Stage.EMB_GRAD),
    ]
    ops = {n: s.submit(n, st, fn(n, 0.02)) for n, st in order}
    s.flush()
    assert [o.name for o in s.issued] == ["hist", "cand", "neg", "next", "grad"]
    assert s.wait(ops["neg"]) == "neg"
    for n in ("hist", "cand", "grad", "next"):
        assert s.wait(ops[n]) == n
    for o in s.issued:
        assert o.t_end <= o.t_wait1  # the consumer starts after the op finished
    starts = [o.t_start for o in s.issued]
    assert starts == sorted(starts)  # executed in issue order
    assert ops["neg"].exposed > 0.03  # it waited behind hist and cand
    s.close()


def test_fifo_and_blocking_policies():
    s = CommScheduler("overlapped")
    ops = [s.submit(n, st, lambda n=n: n) for n, st in [("b", Stage.NEGATIVE), ("a", Stage.HISTORY)]]
    s.flush()
    assert [o.name for o in s.issued] == ["b", "a"] and [s.wait(o) for o in ops] == ["b", "a"]
    s.close()
    s = CommScheduler("blocking")
    op = s.submit("x", Stage.HISTORY, lambda: time.sleep(0.01) or 7)
    assert op.issue == 0 and op.waited and op.exposed >= 0.01 and s.wait(op) == 7
    with pytest.raises(ValueError, match="comm.policy"):
        CommScheduler("eager")


def test_failed_op_surfaces_at_wait():
    s = CommScheduler("prioritized")
    op = s.submit("bad", Stage.HISTORY, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        s.wait(op)
    s.close()


def _check_records(recs):
    errs = []
    for r in recs:
        if r["t_end"] > r["t_wait1"]:
            errs.append(f"{r['name']} step {r['step']}: consumer started before the op finished")
    by_step = {}
    for r in recs:
        by_step.setdefault(r["step"], []).append(r)
    for step, rs in by_step.items():
        names = [r["name"] for r in rs]  # issue order
        rows = [n for n in names if n.endswith("_rows")]
        if rows != ["history_rows", "candidate_rows", "negative_rows"]:
            errs.append(f"step {step}: this batch's embeddings issued as {rows}")
        ahead = [i for i, n in enumerate(names) if n.startswith("next_")]
        if ahead and min(ahead) < names.index("negative_rows"):
            errs.append(f"step {step}: next batch's ids issued before this batch's embeddings: {names}")
        if step > 0 and any(n.endswith("_ids") and not n.startswith(("next_", "negative_", "emb_grad")) for n in names):
            errs.append(f"step {step}: prefetched ids exchanged again: {names}")
        if "dense_grad" in names and any(
            n.endswith(("_rows", "_ids")) and not n.startswith("emb_grad") for n in names[names.index("dense_grad") :]
        ):
            errs.append(f"step {step}: backward sync issued before forward-critical ops")
    return errs


def test_pipeline_order_equal_on_ranks_and_results_equal_blocking():
    keys = [("blocking", "collective"), ("prioritized", "collective"), ("prioritized", "smfree")]
    cfgs = [asdict(RunConfig(policy=p, transport=t, fused=False, **SMALL)) for p, t in keys]
    out = run_ranks(run_interleaved, 2, cfgs, timeout_s=120)  # one pair of processes, steps interleaved
    res = {k: [out[0][j], out[1][j]] for j, k in enumerate(keys)}
    pr = res[("prioritized", "collective")]
    # identical issue order on both ranks
    assert [(r["name"], r["stage"], r["step"]) for r in pr[0]["records"]] == [
        (r["name"], r["stage"], r["step"]) for r in pr[1]["records"]
    ]
    for rank in range(2):
        assert _check_records(pr[rank]["records"]) == []
        assert _check_records(res[("prioritized", "smfree")][rank]["records"]) == []
    # overlap changes when bytes move, never what is computed: bitwise equal to blocking
    bl = res[("blocking", "collective")]
    for key, r in res.items():
        assert r[0]["transport"] == key[1]
        for rank in range(2):
            assert r[rank]["losses"] == bl[rank]["losses"], key
            assert torch.equal(r[rank]["weight_shard"], bl[rank]["weight_shard"]), key
            assert all(torch.equal(a, b) for a, b in zip(r[rank]["dense"], bl[rank]["dense"], strict=True)), key
    assert bl[0]["losses"][0] != bl[0]["losses"][-1]  # it trained
