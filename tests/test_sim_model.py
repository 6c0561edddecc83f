"""The scale model (benchmarks.sim): the paper's figures, limiting cases, exact accounting
on hand-made failure sequences, monotonicity and determinism."""

import math

import numpy as np
import pytest

from benchmarks.sim.config import FailureKind, SimConfig, load, validate, with_
from benchmarks.sim.engine import checkpoint_interval, simulate
from benchmarks.sim.failures import Failures, draw, job_mtbf_s
from benchmarks.sim.report import PAPER, run


def mean_ett(cfg, mode, seeds=4):
    return float(np.mean([simulate(cfg, mode, s)["ett"] for s in range(seeds)]))


def test_paper_figures_reproduced_within_two_points():
    cfg = SimConfig()  # the paper preset: 98,304 GPUs, 12 groups, a failure every 18 min
    assert job_mtbf_s(cfg) == pytest.approx(18 * 60)
    res = run(cfg)
    for mode in ("sync", "fthsdp"):
        assert abs(res[mode]["ett"]["mean"] - PAPER["ett"][mode]) <= 0.02, (mode, res[mode]["ett"])
    # and the model's own stall per failure matches the published inputs (10 and 3 min)
    assert res["sync"]["stall_per_failure_min"]["mean"] == pytest.approx(10.0, abs=0.5)
    assert res["fthsdp"]["stall_per_failure_min"]["mean"] == pytest.approx(3.0, abs=0.5)


@pytest.mark.parametrize("mode", ["sync", "fthsdp"])
def test_no_failures_gives_full_effective_time(mode):
    cfg = with_(SimConfig(), failures_unit_mtbf_h=0.0)
    r = simulate(cfg, mode, 0)
    assert r["failures"] == 0 and r["ett"] == 1.0
    # a blocking checkpoint write is the only loss left: interval / (interval + write)
    cfg = with_(cfg, checkpoint_write_s=60.0)
    assert simulate(cfg, mode, 0)["ett"] == pytest.approx(240 / 300)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"failures_overlap": "restart"},
        {"checkpoint_write_s": 20.0},
        {"checkpoint_policy": "young_daly", "checkpoint_write_s": 20.0},
    ],
)
def test_one_replica_group_makes_fthsdp_synchronous(changes):
    cfg = with_(SimConfig(), job_replica_groups=1, job_days=5.0, **changes)
    for seed in range(3):
        a, b = simulate(cfg, "sync", seed), simulate(cfg, "fthsdp", seed)
        assert a["failures"] > 100
        assert b["ett"] == pytest.approx(a["ett"], abs=1e-12)
        assert b["rollback"] == pytest.approx(a["rollback"], abs=1e-12) and a["rollback"] > 0


def test_monotone_in_failure_rate():
    base = with_(SimConfig(), job_days=10.0)
    prev = {"sync": 1.01, "fthsdp": 1.01}
    for mtbf_min in (240, 60, 27, 18, 12, 9):
        cfg = with_(base, failures_unit_mtbf_h=mtbf_min * 12_288 / 60)
        for mode in prev:
            e = mean_ett(cfg, mode)
            assert e < prev[mode], (mode, mtbf_min, e, prev[mode])
            prev[mode] = e
        assert prev["fthsdp"] > prev["sync"]


def test_deterministic_by_seed():
    cfg = with_(SimConfig(), job_days=3.0)
    assert simulate(cfg, "fthsdp", 7) == simulate(cfg, "fthsdp", 7)
    assert simulate(cfg, "fthsdp", 7) != simulate(cfg, "fthsdp", 8)
    assert run(cfg, seeds=2) == run(cfg, seeds=2)


def test_more_replica_groups_lose_less_to_a_failure():
    base = with_(SimConfig(), job_days=10.0)
    etts = [mean_ett(with_(base, job_replica_groups=r), "fthsdp") for r in (1, 2, 4, 12, 48)]
    assert etts == sorted(etts) and etts[-1] - etts[0] > 0.3


def test_min_replicas_stalls_the_job_when_too_few_groups_are_live():
    base = with_(SimConfig(), job_days=10.0)
    free = simulate(base, "fthsdp", 0)
    strict = simulate(with_(base, fthsdp_min_replicas=12), "fthsdp", 0)
    assert strict["degraded"] == 0.0  # never steps without every group
    assert strict["stalled"] > free["stalled"] + 0.2  # it waits instead
    assert strict["ett"] < free["ett"]


def _fails(times, groups, weights, horizon, detect=60.0):
    t = np.asarray(times, float)
    return Failures(
        t=t,
        group=np.asarray(groups, np.int64),
        kind=np.zeros(len(t), np.int64),
        detect=np.full(len(t), detect),
        ft_detect=np.full(len(t), detect),
        weights=np.asarray(weights, float),
        horizon=horizon,
    )


def test_exact_accounting_of_one_failure():
    cfg = SimConfig()  # restart after detection: 180 + 120 + 120 + 60 s; checkpoint every 240 s
    H = 100_000.0
    f = _fails([1000.0], [3], np.full(12, 1 / 12), H)
    s = simulate(cfg, "sync", fails=f)
    restart = 60 + 180 + 120 + 120 + 60
    assert s["ett"] == pytest.approx((H - restart - 1000 % 240) / H)
    assert s["rollback"] == pytest.approx(40 / H)  # 1000 s in, last checkpoint at 960 s
    ft = simulate(cfg, "fthsdp", fails=f)
    stall = 60 + 120  # detection + reconfiguration, every group waits
    back = 60 + 180 + 120 + 120 + 60  # the group heals from a live peer (heal_s = 120)
    assert ft["stalled"] == pytest.approx(stall / H)
    assert ft["degraded"] == pytest.approx((back - stall) / 12 / H)
    assert ft["rollback"] == 0.0
    assert ft["ett"] == pytest.approx(1 - (stall + (back - stall) / 12) / H)


def test_overlapping_failures_queue_or_restart():
    H, restart = 50_000.0, 60 + 180 + 120 + 120 + 60
    f = _fails([1000.0, 1100.0], [0, 0], [1.0], H)
    lost = 1000 % 240
    q = simulate(SimConfig(), "sync", fails=f)
    assert q["stalled"] == pytest.approx(2 * restart / H)  # the second restart waits for the first
    r = simulate(with_(SimConfig(), failures_overlap="restart"), "sync", fails=f)
    assert r["stalled"] == pytest.approx((100 + restart) / H)  # the second restart replaces the first
    assert q["rollback"] == r["rollback"] == pytest.approx(lost / H)  # no progress between them to lose


def test_every_group_down_rolls_back_to_the_checkpoint():
    cfg = SimConfig()
    H = 50_000.0
    f = _fails([1000.0, 1010.0], [0, 1], [0.5, 0.5], H)  # both groups of a 2-group job fail together
    ft = simulate(cfg, "fthsdp", fails=f)
    assert ft["rollback"] > 0
    # nothing stepped between the failures (the first one's stall); the progress since the last
    # checkpoint (1000 s in, checkpoint at 960 s) is gone
    assert ft["rollback"] * H == pytest.approx(40.0)


def test_overlapping_stalls_and_groups_down():
    H = 50_000.0
    f = _fails([1000.0, 1050.0], [0, 1], np.full(4, 0.25), H)
    ft = simulate(SimConfig(), "fthsdp", fails=f)
    # stalls queue: 180 s each, the second starts when the first ends
    assert ft["stalled"] == pytest.approx(360 / H)
    assert ft["groups_down"] == pytest.approx(2 * 540 / H)


def test_lr_policy_effect_on_progress_is_explicit():
    base = with_(SimConfig(), job_days=5.0, job_replica_groups=4)
    samples = simulate(base, "fthsdp", 0)
    lin = simulate(with_(base, fthsdp_progress="lr", fthsdp_lr_policy="linear"), "fthsdp", 0)
    sq = simulate(with_(base, fthsdp_progress="lr", fthsdp_lr_policy="sqrt"), "fthsdp", 0)
    const = simulate(with_(base, fthsdp_progress="lr", fthsdp_lr_policy="constant"), "fthsdp", 0)
    assert lin["ett"] == pytest.approx(samples["ett"])
    assert samples["ett"] < sq["ett"] < const["ett"]
    assert const["degraded"] == 0.0
    # the synchronous baseline has no degraded steps to weigh
    assert simulate(with_(base, fthsdp_progress="lr"), "sync", 0) == simulate(base, "sync", 0)


def test_young_daly_interval():
    cfg = with_(SimConfig(), checkpoint_policy="young_daly", checkpoint_write_s=10.0)
    m = job_mtbf_s(cfg)
    assert checkpoint_interval(cfg) == pytest.approx(math.sqrt(2 * 10 * m), rel=0.1)
    assert checkpoint_interval(with_(cfg, checkpoint_write_s=0.0)) == 0.0
    # with a costly write the optimum beats a far-off fixed interval
    yd = mean_ett(with_(cfg, checkpoint_write_s=30.0, job_days=5.0), "sync")
    fixed = mean_ett(
        with_(cfg, checkpoint_policy="fixed", checkpoint_interval_s=3600.0, checkpoint_write_s=30.0, job_days=5.0),
        "sync",
    )
    assert yd > fixed


def test_failure_kinds_and_units():
    cfg = with_(
        SimConfig(), job_days=5.0, failures_kinds=[FailureKind("crash", 3, 10.0), FailureKind("hang", 1, 600.0)]
    )
    f = draw(cfg, 0)
    share_hang = float(np.mean(f.kind == 1))
    assert 0.2 < share_hang < 0.3
    assert set(np.unique(f.detect)) == {10.0, 600.0}
    # slower detection costs more
    assert mean_ett(cfg, "sync", 2) < mean_ett(with_(cfg, failures_kinds=[FailureKind("crash", 1, 10.0)]), "sync", 2)
    # per-GPU failures at the same per-GPU rate give the same job rate
    gpu = with_(SimConfig(), failures_unit="gpu", failures_unit_mtbf_h=3686.4 * 8)
    assert job_mtbf_s(gpu) == pytest.approx(job_mtbf_s(SimConfig()))
    groups = draw(gpu, 0).group
    assert groups.min() == 0 and groups.max() == 11


def test_config_file_and_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(
        '[job]\ngpus = 16384\nreplica_groups = 2\n[[failures.kinds]]\nname = "crash"\nshare = 1\ndetect_s = 5\n'
    )
    cfg = load(p, ["fthsdp.lr_policy=linear", "checkpoint.interval_s=600", "sweep.scales=[1024, 2048]"])
    assert cfg.job.gpus == 16384 and cfg.job.replica_groups == 2
    assert cfg.failures.kinds == [FailureKind("crash", 1.0, 5.0)]
    assert cfg.fthsdp.lr_policy == "linear" and cfg.checkpoint.interval_s == 600.0
    assert cfg.sweep.scales == [1024, 2048]


@pytest.mark.parametrize(
    "sets, words",
    [
        (["job.gpu=8"], ["job.gpu", "unknown key"]),
        (["job.gpus=abc"], ["job.gpus", "as int"]),
        (["job.gpus=12"], ["multiple of job.gpus_per_server"]),
        (["nosuch.key=1"], ["unknown section 'nosuch'"]),
        (["fthsdp.lr_policy=cubic"], ["fthsdp.lr_policy", "sqrt"]),
        (["fthsdp.min_replicas=13"], ["fthsdp.min_replicas"]),
        (["jobgpus"], ["section.key=value"]),
    ],
)
def test_config_errors_name_the_setting(sets, words):
    from benchmarks.sim.config import SimConfigError

    with pytest.raises(SimConfigError) as e:
        load(None, sets)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "\n" not in str(e.value)


def test_validate_rejects_bad_kinds():
    from benchmarks.sim.config import SimConfigError

    with pytest.raises(SimConfigError, match="failures.kinds"):
        validate(with_(SimConfig(), failures_kinds=[FailureKind("x", 0.0, 1.0)]))


def test_fthsdp_can_checkpoint_less_often():
    cfg = with_(SimConfig(), job_days=5.0, checkpoint_write_s=20.0)
    same = simulate(cfg, "fthsdp", 0)
    rare = simulate(with_(cfg, checkpoint_fthsdp_interval_s=3600.0), "fthsdp", 0)
    assert rare["checkpoint"] < same["checkpoint"] / 10 and rare["ett"] > same["ett"]
    assert simulate(with_(cfg, checkpoint_fthsdp_interval_s=3600.0), "sync", 0) == simulate(cfg, "sync", 0)
