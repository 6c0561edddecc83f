"""Checkpoint round trip, exact mid-epoch resume, safe loading, and `training eval` on a checkpoint."""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from dataprep.build import build_shards
from dataprep.synth import write_synthetic
from training import checkpoint
from training.config import load_config
from training.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("ckpt")
    write_synthetic(str(d / "ev.txt"), users=300, items=150, seed=2, median_len=8, max_history=60)
    build_shards(str(d / "ev.txt"), "sasrec", str(d / "shards"), world_size=2, batch_size=12, max_len=16)
    return str(d / "shards")


def _cfg(shards: str, out, *extra: str):
    return load_config(None, [f"data.shards={shards}", f"train.out={out}", "train.epochs=2", "mlflow.enabled=false",
                              "train.log_every=4", "train.checkpoint_every=0", "model.dropout=0.2",
                              "model.dim=16", "optim.warmup_steps=5", *extra])


def _state(path: str) -> dict:
    return checkpoint.load(path)


def _assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_resume_mid_epoch_is_bitwise_identical(shards, tmp_path):
    full = train(_cfg(shards, tmp_path / "full"))
    steps_per_epoch = json.load(open(os.path.join(shards, "manifest.json")))["steps"]
    stop = steps_per_epoch + steps_per_epoch // 2 + 1           # in the middle of the second epoch
    first = train(_cfg(shards, tmp_path / "cut", f"train.stop_at_step={stop}"))
    assert first["steps"] == stop and checkpoint.list_steps(str(tmp_path / "cut" / "checkpoints")) == [stop]
    meta = checkpoint.read_meta(first["checkpoint"])
    assert (meta["epoch"], meta["index"]) == (1, stop - steps_per_epoch)
    resumed = train(_cfg(shards, tmp_path / "cut", "train.resume=true"))
    assert resumed["steps"] == full["steps"] == 2 * steps_per_epoch
    a, b = _state(full["checkpoint"]), _state(resumed["checkpoint"])
    _assert_same(a, b)                       # model, optimizer, scheduler, cursor, RNG: all equal
    assert resumed["metrics"] == full["metrics"]
    # and the cut run really was different at the cut (the comparison can fail)
    assert not torch.equal(_state(first["checkpoint"])["model"]["item_emb.weight"], a["model"]["item_emb.weight"])


def test_round_trip_and_safe_loading(shards, tmp_path):
    res = train(_cfg(shards, tmp_path / "rt", "train.max_steps=6", "train.checkpoint_every=3", "eval.periodic=false",
                     "train.keep_checkpoints=5"))
    root = str(tmp_path / "rt" / "checkpoints")
    assert checkpoint.list_steps(root) == [3, 6]
    os.makedirs(os.path.join(root, "step-00000009.tmp"))    # a crashed save: never picked up
    assert checkpoint.latest(root) == res["checkpoint"]
    state = _state(res["checkpoint"])
    assert set(state) == {"step", "model", "optimizer", "scheduler", "cursor", "rng"}
    assert state["step"] == 6 and state["cursor"]["index"] == 6

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    bad = tmp_path / "bad"
    bad.mkdir()
    with open(bad / "state.pt", "wb") as f:
        pickle.dump({"model": Evil()}, f)
    with pytest.raises(checkpoint.CheckpointError, match="cannot be loaded safely"):
        checkpoint.load(str(bad))
    with pytest.raises(checkpoint.CheckpointError, match="no state.pt"):
        checkpoint.load(str(tmp_path))


def test_eval_cli_matches_training_result(shards, tmp_path):
    res = train(_cfg(shards, tmp_path / "ev", "train.max_steps=8", "eval.periodic=false"))
    out = tmp_path / "metrics.json"
    p = subprocess.run([sys.executable, "-m", "training", "eval", "--checkpoint", res["checkpoint"],
                        "--shards", shards, "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    got = json.load(open(out))
    assert got.keys() == res["metrics"].keys()
    for k, v in res["metrics"].items():
        assert got[k] == pytest.approx(v, abs=1e-9), k
