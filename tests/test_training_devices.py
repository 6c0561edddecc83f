"""One GPU per rank (training/distributed.py `rank_device`, the launcher's GPU slots), with the
GPU count faked: this machine has none."""

import pytest
import torch

from training import distributed
from training.config import ConfigError
from training.launch import TOY, TrainerLaunchConfig, TrainerLauncher, parse


def _env(local, per_group, slot=None, slots=None, oversubscribe=False):
    env = {"LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(per_group)}
    if slot is not None:
        env.update(FTREC_GPU_SLOT=str(slot), FTREC_GPU_SLOTS=str(slots))
    if oversubscribe:
        env["FTREC_OVERSUBSCRIBE_GPUS"] = "1"
    return env


def test_no_gpu_is_the_cpu():
    assert distributed.rank_device(_env(1, 2, 1, 2), device_count=0) == torch.device("cpu")


def test_every_rank_of_every_group_gets_its_own_gpu():
    got = [distributed.rank_device(_env(k, 2, g, 2), device_count=4) for g in range(2) for k in range(2)]
    assert [d.index for d in got] == [0, 1, 2, 3] and {d.type for d in got} == {"cuda"}


def test_torchrun_on_a_cluster_takes_local_rank():
    assert distributed.rank_device(_env(3, 8), device_count=8) == torch.device("cuda", 3)


def test_too_few_gpus_is_refused_unless_groups_may_share_them():
    with pytest.raises(ConfigError, match="need 2 GPUs, 1 visible.*--oversubscribe-gpus"):
        distributed.rank_device(_env(0, 1, 1, 2), device_count=1)
    shared = [distributed.rank_device(_env(0, 1, g, 2, oversubscribe=True), device_count=1) for g in range(2)]
    assert shared == [torch.device("cuda", 0)] * 2
    # 3 groups x 2 ranks on 4 GPUs: groups share, the ranks of one group never do
    for g in range(3):
        pair = [distributed.rank_device(_env(k, 2, g, 3, oversubscribe=True), device_count=4) for k in range(2)]
        assert pair[0] != pair[1]


def test_two_ranks_of_one_group_never_share_a_gpu():
    with pytest.raises(ConfigError, match="NCCL cannot put two ranks of one group on one GPU"):
        distributed.rank_device(_env(0, 2, 0, 1, oversubscribe=True), device_count=1)


def test_the_count_comes_from_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert distributed.rank_device(_env(0, 1, 2, 3)) == torch.device("cuda", 2)
    with pytest.raises(ConfigError):
        distributed.rank_device(_env(0, 2, 1, 2))


def test_the_launcher_gives_each_of_its_groups_a_slot(tmp_path):
    launcher = TrainerLauncher(
        TrainerLaunchConfig(
            worker=TOY, replica_groups=4, ranks_per_group=2, groups=[1, 3], lighthouse="127.0.0.1:1", out=str(tmp_path)
        )
    )
    env = launcher.rank_env(3, 1, 0, 1234)
    assert (env["FTREC_GPU_SLOT"], env["FTREC_GPU_SLOTS"], env["LOCAL_RANK"]) == ("1", "2", "1")
    assert distributed.rank_device(env, device_count=4) == torch.device("cuda", 3)
    assert "FTREC_OVERSUBSCRIBE_GPUS" not in launcher.job_env()
    cfg = parse(["--worker", TOY, "--out", str(tmp_path), "--oversubscribe-gpus"])
    assert cfg.oversubscribe_gpus and TrainerLauncher(cfg).job_env()["FTREC_OVERSUBSCRIBE_GPUS"] == "1"
