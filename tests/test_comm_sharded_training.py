"""The trainer with `comm.embedding = "sharded"`: real gloo ranks (torchrun) against the
replicated table on the same shards.

With 2 ranks, dropout off and clipping off, every float addition of the sharded run happens
in the order of the replicated one (training/comm/item_table.py), so per-step losses and the
final model must be bitwise equal. With clipping on, the global norm is assembled from shard
norms (a different summation order than one norm of the full table), so that run is compared
with a tight tolerance. Every comm.policy (the lookups inline, or submitted before the forward
pass with the next batch's id exchange running during the step) gives the same results.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import synthetic_shards, torchrun_train

from training import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = [
    "loss.kind=sampled_softmax",  # one loss for both tables (auto: softmax on a replicated one only)
    "train.max_steps=8",
    "model.dropout=0",
    "model.dim=16",
    "train.log_every=1",
    "mlflow.enabled=false",
    "optim.warmup_steps=2",
    "eval.periodic=false",
]


def _torchrun(shards: str, out: str, port: int, extra: list[str]) -> str:
    return torchrun_train(shards, out, port, [*SETTINGS, *extra])


def _losses(text: str) -> list[str]:
    return re.findall(r"step (\d+)/\d+ epoch \d+ loss (\S+)", text)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return str(
        synthetic_shards(
            tmp_path_factory.mktemp("sharded"), users=200, items=90, seed=5, world_size=2, batch_size=8, max_len=20
        )
    )


@pytest.fixture(scope="module")
def replicated(shards, tmp_path_factory):
    """The replicated-table run per grad_clip setting, run once: (output text, out folder)."""
    runs = {}

    def get(clip: str, port: int) -> tuple[str, str]:
        if clip not in runs:
            out = str(tmp_path_factory.mktemp(f"rep-{clip}"))
            runs[clip] = (_torchrun(shards, out, port, [f"optim.grad_clip={clip}"]), out)
        return runs[clip]

    return get


def _result(out) -> dict:
    return json.load(open(os.path.join(out, "result.json")))


@pytest.mark.integ
@pytest.mark.parametrize(
    "clip,comm",
    [
        ("0", ["comm.transport=collective"]),  # prioritized pipeline (default)
        ("1.0", ["comm.transport=collective"]),
        ("0", ["comm.transport=smfree"]),
        ("0", ["comm.transport=collective", "comm.policy=blocking"]),  # lookups inline
        ("0", ["comm.transport=smfree", "comm.policy=overlapped"]),  # async, FIFO
    ],
)
def test_sharded_table_trains_like_replicated(shards, replicated, tmp_path, free_port, clip, comm):
    rep, rep_out = replicated(clip, free_port)  # replicated, gloo all-reduce
    shd = _torchrun(
        shards, str(tmp_path / "shd"), free_port, [f"optim.grad_clip={clip}", "comm.embedding=sharded", *comm]
    )
    assert "item table sharded row-wise over 2 ranks" in shd and "item table sharded" not in rep
    assert len(_losses(rep)) == 8 and _losses(shd) == _losses(rep)
    a = checkpoint.load(_result(rep_out)["checkpoint"])
    r1 = _result(tmp_path / "shd")
    # the pipeline: from step 2 on, every step's id exchange ran during the step before it
    policy = (
        "blocking"
        if "comm.policy=blocking" in comm
        else "overlapped"
        if "comm.policy=overlapped" in comm
        else "prioritized"
    )
    assert {k: r1["comm"][k] for k in ("policy", "prefetch_hits", "prefetch_misses")} == {
        "policy": policy,
        "prefetch_hits": 7,
        "prefetch_misses": 0,
    }
    assert r1["comm"]["lookup_wait_s"] > 0 and r1["comm"]["emb_grad_wait_s"] > 0
    b = checkpoint.load(r1["checkpoint"])
    assert b["model"]["item_emb.weight"].shape == a["model"]["item_emb.weight"].shape  # the full table
    for name, w in a["model"].items():
        v = b["model"][name]
        if clip == "0":
            assert torch.equal(w, v), name
            continue
        # clip coefficient from sqrt(dense^2 + sum of shard norms^2): last-bit differences
        if name.endswith("qkv.bias"):
            # as in test_training_distributed: the key bias has an exactly-zero true gradient and
            # Adam turns float noise into full-size steps; compare the q and v parts
            d = w.numel() // 3
            w, v = torch.cat([w[:d], w[2 * d :]]), torch.cat([v[:d], v[2 * d :]])
        assert torch.allclose(w, v, atol=1e-6, rtol=1e-5), name
    # rank 1 kept its shard's optimizer state in its own file, for an exact resume
    assert "optimizer" in checkpoint.load(r1["checkpoint"], 1, per_rank=("rng", "optimizer"))
    if clip == "0":
        assert r1["metrics"] == _result(rep_out)["metrics"]


@pytest.mark.integ
def test_sharded_warm_start_equals_replicated_warm_start(shards, replicated, tmp_path, free_port):
    """Warm start loads the full table before sharding: the same run as a replicated warm start."""
    _, rep_out = replicated("0", free_port)
    init = [
        f"train.init_checkpoint={_result(rep_out)['checkpoint']}",
        "train.max_steps=4",
        "optim.grad_clip=0",
        "eval.final=false",
        "loss.kind=bce",
    ]
    rep = _torchrun(shards, str(tmp_path / "rep"), free_port, init)
    shd = _torchrun(shards, str(tmp_path / "shd"), free_port, [*init, "comm.embedding=sharded"])
    assert "warm start from" in shd and "90/90 item embeddings carried over" in shd
    assert len(_losses(rep)) == 4 and _losses(shd) == _losses(rep)
    a = checkpoint.load(_result(tmp_path / "rep")["checkpoint"])["model"]
    b = checkpoint.load(_result(tmp_path / "shd")["checkpoint"])["model"]
    assert all(torch.equal(w, b[k]) for k, w in a.items())


@pytest.mark.integ
def test_sharded_resume_is_exact(shards, tmp_path, free_port):
    """Stop at step 4, resume to 8: the same model as one uninterrupted sharded run."""
    extra = ["optim.grad_clip=0", "comm.embedding=sharded", "eval.final=false"]
    whole = _torchrun(shards, str(tmp_path / "whole"), free_port, extra)
    _torchrun(shards, str(tmp_path / "split"), free_port, [*extra, "train.stop_at_step=4"])
    resumed = _torchrun(shards, str(tmp_path / "split"), free_port, [*extra, "train.resume=true"])
    assert _losses(resumed) == _losses(whole)[4:]
    a = checkpoint.load(json.load(open(tmp_path / "whole" / "result.json"))["checkpoint"])
    b = checkpoint.load(json.load(open(tmp_path / "split" / "result.json"))["checkpoint"])
    for name, w in a["model"].items():
        assert torch.equal(w, b["model"][name]), name


def test_comm_settings_are_checked(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "training",
            "train",
            "--shards",
            str(tmp_path),
            "--out",
            str(tmp_path / "o"),
            "--set",
            "comm.embedding=sharded",
            "comm.policy=eager",
        ],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert "comm.policy must be one of blocking, overlapped, prioritized" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run(
        [sys.executable, "-m", "training", "train", "--shards", str(tmp_path), "--set", "comm.embedding=rowwise"],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert p.returncode != 0 and "comm.embedding must be one of auto, replicated, sharded" in p.stderr
