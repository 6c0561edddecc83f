"""Bubble accounting: compute + comm + idle = step time, straggler wait inside comm, the
bubble fraction, the metrics dict and the PNG timeline."""

from dataclasses import asdict

import pytest
import torch

from benchmarks.comm_bench import RunConfig, run_training
from benchmarks.spawn import run_ranks
from training.comm.bubbles import (
    Interval,
    PhaseLog,
    StepAccount,
    StepPhases,
    account,
    bubble_fraction,
    metrics,
    plot_timeline,
)
from training.comm.scheduler import CommScheduler, Stage


class FakeClock:
    """A clock the test advances by hand, so the expected sums are exact."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_account_exact_on_a_scripted_step():
    clk = FakeClock()
    tl = PhaseLog(0, clock=clk)
    sched = CommScheduler("blocking", timeline=tl, clock=clk)
    tl.step_begin(0)
    clk.t = 1.0  # 1.0 idle (data loading)
    with tl.compute("forward"):
        clk.t = 3.0  # 2.0 compute
        with tl.compute("inner"):  # nested: counted once
            clk.t = 4.0  # 1.0 compute

        def comm():
            clk.t = 6.5  # 2.5 comm, inside the forward: splits it

        sched.submit("op", Stage.HISTORY, comm)
        clk.t = 7.0  # 0.5 compute
    clk.t = 8.0  # 1.0 idle
    tl.step_end()
    (a,) = account(tl.steps, 0, arrivals={0: 5.0})  # the last rank arrived at 5.0
    assert (a.step_time, a.compute, a.comm, a.idle) == (8.0, 3.5, 2.5, 2.0)
    assert a.straggler == pytest.approx(1.0)  # waited 4.0 -> 5.0 for the peer
    assert a.bubble_fraction == pytest.approx(1 - 3.5 / 8.0)
    kinds = [(i.kind, i.t0, i.t1) for i in tl.steps[0].intervals]
    assert kinds == [("compute", 1.0, 4.0), ("comm", 4.0, 6.5), ("compute", 6.5, 7.0)]


def test_bubble_fraction_and_metrics():
    accts = [StepAccount(0, 0, 10.0, 10.0, 0.0, 0.0, 0.0), StepAccount(1, 0, 10.0, 5.0, 5.0, 5.0, 0.0)]
    assert bubble_fraction(accts) == pytest.approx(0.25)  # = 1 - mean/max for a pure straggler
    m = metrics(accts)
    assert m["comm/bubble_fraction"] == pytest.approx(0.25) and m["comm/straggler_s"] == 2.5


def test_png_is_written(tmp_path):
    steps = [
        StepPhases(0, 0.0, 2.0, [Interval("compute", "f", 0.1, 1.0), Interval("comm", "x", 1.0, 1.5, 0, 1.0)]),
        StepPhases(1, 2.0, 3.0, [Interval("compute", "f", 2.0, 2.9)]),
    ]
    p = plot_timeline([steps, steps], str(tmp_path / "t.png"), arrivals={0: 1.2}, num_steps=2)
    assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert [f.name for f in tmp_path.iterdir()] == ["t.png"]  # no temp file left


@pytest.mark.integ
def test_sums_on_real_ranks_with_a_straggler(tmp_path):
    # heavy-tailed random shards: one rank computes more, the other waits in the collectives
    cfg = RunConfig(
        policy="prioritized",
        data="lognormal",
        balanced=False,
        steps=4,
        warmup=1,
        num_items=500,
        dim=16,
        d_model=16,
        batch=4,
        max_len=80,
        num_neg=32,
    )
    res = run_ranks(run_training, 2, asdict(cfg), timeout_s=120)
    straggler = 0.0
    for r in res:
        assert len(r["accounts"]) == 3
        for a in r["accounts"]:
            assert a["compute"] > 0 and a["comm"] > 0 and a["idle"] >= 0
            assert a["compute"] + a["comm"] + a["idle"] == pytest.approx(a["step_time"], rel=1e-9, abs=1e-9)
            assert 0 <= a["straggler"] <= a["comm"] + 1e-12
            straggler += a["straggler"]
        m = r["metrics"]
        assert 0 < m["comm/bubble_fraction"] < 1
    assert straggler > 0
    steps = [PhaseLog.from_json(r["timeline"]) for r in res]
    png = plot_timeline(steps, str(tmp_path / "w.png"), arrivals={int(k): v for k, v in res[0]["arrivals"].items()})
    assert open(png, "rb").read(4) == b"\x89PNG"


def _group_comm(rank, world_size, out):
    import torch

    from training.comm.integration import CommConfig, GroupComm
    from training.distributed import allreduce_grads as trainer_allreduce

    res = {}
    for kind in ("collective", "smfree", "default"):
        # "default": the trainer's own all-reduce, timed by GroupComm (comm.transport=collective)
        gc = GroupComm(CommConfig(transport="collective" if kind == "default" else kind, timeline_steps=3), rank)
        torch.manual_seed(rank)
        params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(7))]
        grads = []
        for step in range(6):
            gc.step_begin(step)
            with gc.compute("forward_backward"):
                for p in params:
                    p.grad = torch.randn_like(p) * (rank + 1)
            gc.allreduce_grads(params, default=trainer_allreduce if kind == "default" else None)
            grads.append([p.grad.clone() for p in params])
            with gc.compute("optimizer"):
                pass
            gc.step_end()
            if step in (1, 4):
                res.setdefault("metrics", {})[kind] = gc.window_metrics()
        kept = (len(gc.timeline.steps), len(gc.sched.issued))  # pruned to the PNG's window
        png = gc.finish(out)
        res[kind] = (gc.transport.name, grads, png, kept)
    return res


@pytest.mark.integ
def test_group_comm_seam(tmp_path):
    r0, r1 = run_ranks(_group_comm, 2, str(tmp_path), timeout_s=90)
    for kind in ("collective", "smfree", "default"):
        assert r0[kind][0] == ("collective" if kind == "default" else kind)
        for a, b, c in zip(r0[kind][1], r1[kind][1], r0["collective"][1], strict=True):
            # both ranks hold the group's SUM, bitwise the same with either transport
            assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c, strict=True))
        m = r0["metrics"][kind]
        assert m == r1["metrics"][kind]  # averaged over the group
        assert 0 <= m["comm/bubble_fraction"] <= 1 and m["comm/comm_s"] > 0
        assert m["comm/exposed/dense_grad_s"] == pytest.approx(m["comm/comm_s"])  # the only op
        assert m["comm/smfree"] == float(kind == "smfree")
        assert r0[kind][3] == (4, 4)  # the last 3 steps kept at step 4's window, plus step 5
    assert r0["smfree"][2].endswith("comm_timeline.png") and r1["smfree"][2] is None
    assert open(r0["smfree"][2], "rb").read(4) == b"\x89PNG"
