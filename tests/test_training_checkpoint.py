"""Checkpoint round trip, exact mid-epoch resume, safe loading, and `training eval` on a checkpoint."""

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from conftest import run_python, synthetic_shards

from dataprep.build import build_shards
from dataprep.synth import write_synthetic
from training import checkpoint
from training.config import load_config
from training.train import train


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    return str(
        synthetic_shards(
            tmp_path_factory.mktemp("ckpt"),
            users=300,
            items=150,
            seed=2,
            world_size=2,
            batch_size=12,
            max_len=16,
            max_history=60,
        )
    )


def _cfg(shards: str, out, *extra: str):
    return load_config(
        None,
        [
            f"data.shards={shards}",
            f"train.out={out}",
            "train.epochs=2",
            "mlflow.enabled=false",
            "train.log_every=4",
            "train.checkpoint_every=0",
            "model.dropout=0.2",
            "model.dim=16",
            "optim.warmup_steps=5",
            *extra,
        ],
    )


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
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_resume_mid_epoch_is_bitwise_identical(shards, tmp_path):
    full = train(_cfg(shards, tmp_path / "full"))
    steps_per_epoch = json.load(open(os.path.join(shards, "manifest.json")))["steps"]
    stop = steps_per_epoch + steps_per_epoch // 2 + 1  # in the middle of the second epoch
    first = train(_cfg(shards, tmp_path / "cut", f"train.stop_at_step={stop}"))
    assert first["steps"] == stop and checkpoint.list_steps(str(tmp_path / "cut" / "checkpoints")) == [stop]
    meta = checkpoint.read_meta(first["checkpoint"])
    assert (meta["epoch"], meta["index"]) == (1, stop - steps_per_epoch)
    resumed = train(_cfg(shards, tmp_path / "cut", "train.resume=true"))
    assert resumed["steps"] == full["steps"] == 2 * steps_per_epoch
    a, b = _state(full["checkpoint"]), _state(resumed["checkpoint"])
    _assert_same(a, b)  # model, optimizer, scheduler, cursor, RNG: all equal
    assert resumed["metrics"] == full["metrics"]
    # and the cut run really was different at the cut (the comparison can fail)
    assert not torch.equal(_state(first["checkpoint"])["model"]["item_emb.weight"], a["model"]["item_emb.weight"])


def test_round_trip_and_safe_loading(shards, tmp_path):
    res = train(
        _cfg(
            shards,
            tmp_path / "rt",
            "train.max_steps=6",
            "train.checkpoint_every=3",
            "eval.periodic=false",
            "train.keep_checkpoints=5",
        )
    )
    root = str(tmp_path / "rt" / "checkpoints")
    assert checkpoint.list_steps(root) == [3, 6]
    os.makedirs(os.path.join(root, "step-00000009.tmp"))  # a crashed save: never picked up
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
    (bad / "meta.json").write_text('{"step": 0}')
    checkpoint.rekey(str(bad))  # sealed: even a file the key vouches for is never run
    with pytest.raises(checkpoint.CheckpointError, match="cannot be loaded safely"):
        checkpoint.load(str(bad))
    with pytest.raises(checkpoint.CheckpointError, match="no state.pt"):
        checkpoint.load(str(tmp_path))


def _eval_cli(ckpt: str, shards: str, out) -> dict:
    """`python -m training eval` on a checkpoint, as a user runs it; the metrics it wrote."""
    p = run_python(["-m", "training", "eval", "--checkpoint", ckpt, "--shards", shards, "--out", str(out)], 180)
    assert p.returncode == 0, p.stdout[-3000:]
    return json.loads(Path(out).read_text())


def test_eval_cli_matches_training_result(shards, tmp_path):
    res = train(_cfg(shards, tmp_path / "ev", "train.max_steps=8", "eval.periodic=false"))
    out = tmp_path / "metrics.json"
    got = _eval_cli(res["checkpoint"], shards, out)
    assert got.keys() == res["metrics"].keys()
    for k, v in res["metrics"].items():
        assert got[k] == pytest.approx(v, abs=1e-9), k


def test_warm_start_carries_items_by_raw_id(shards, tmp_path):
    """Retraining on new data: known items keep their learned rows even though new raw ids
    shift the dense ids; new items keep a fresh row; every other weight is carried as is."""
    import pyarrow.parquet as pq

    from dataprep.schema import ITEM_MAP
    from training.model import SeqRec

    first = train(_cfg(shards, tmp_path / "first", "train.epochs=1"))
    # the same interactions plus a user whose items have raw ids that sort first ("0...")
    src = os.path.join(os.path.dirname(shards), "ev.txt")
    grown = tmp_path / "grown.txt"
    grown.write_text(open(src).read() + "".join(f"99999 0{i}\n" for i in range(6)))
    build_shards(str(grown), "sasrec", str(tmp_path / "grown"), world_size=2, batch_size=12, max_len=16)

    cfg = _cfg(str(tmp_path / "grown"), tmp_path / "second", "train.epochs=1")
    new_map = pq.read_table(tmp_path / "grown" / ITEM_MAP).to_pydict()
    cfg.model.max_len = 16
    model = SeqRec(max(new_map["id"]), cfg.model)
    fresh = model.item_emb.weight.detach().clone()
    carried = checkpoint.warm_start(model, first["checkpoint"], str(tmp_path / "grown"))

    old = checkpoint.load(first["checkpoint"])["model"]
    old_map = pq.read_table(os.path.join(shards, ITEM_MAP)).to_pydict()
    old_row = dict(zip(old_map["raw_id"], old_map["id"], strict=True))
    w = model.item_emb.weight.detach()
    shifted = 0
    for nid, raw in zip(new_map["id"], new_map["raw_id"], strict=True):
        if raw in old_row:
            assert torch.equal(w[nid], old["item_emb.weight"][old_row[raw]]), raw
            shifted += nid != old_row[raw]
        else:
            assert torch.equal(w[nid], fresh[nid]), raw
    assert carried == len(old_map["id"]) and shifted > 0  # ids really moved, rows followed them
    for k, v in model.state_dict().items():
        if k != "item_emb.weight":
            assert torch.equal(v, old[k]), k

    # and through the CLI setting, end to end
    second = train(
        load_config(
            None,
            [
                *(f"{k}={v}" for k, v in [("data.shards", tmp_path / "grown"), ("train.out", tmp_path / "second2")]),
                "train.epochs=1",
                "mlflow.enabled=false",
                "model.dim=16",
                "model.dropout=0.2",
                f"train.init_checkpoint={first['checkpoint']}",
            ],
        )
    )
    assert second["steps"] > 0


def test_warm_start_refuses_a_different_model(shards, tmp_path):
    first = train(_cfg(shards, tmp_path / "first", "train.epochs=1"))
    cfg = _cfg(
        shards, tmp_path / "other", "train.epochs=1", "model.dim=24", f"train.init_checkpoint={first['checkpoint']}"
    )
    with pytest.raises(checkpoint.CheckpointError, match="does not fit this model"):
        train(cfg)


def test_best_validation_model_is_the_runs(tmp_path):
    """eval.best_metric: the model where validation peaked, not the last, is evaluated, saved
    under OUT/best/ and named by result.json; the last checkpoint stays for resume."""
    write_synthetic(str(tmp_path / "ev.txt"), users=200, items=90)
    build_shards(str(tmp_path / "ev.txt"), "sasrec", str(tmp_path / "shards"), world_size=1, batch_size=16, max_len=20)
    shards = str(tmp_path / "shards")
    # seeded and deterministic: on this data the full-ranking NDCG peaks mid-run (lr high, no dropout)
    res = train(
        load_config(
            None,
            [
                f"data.shards={shards}",
                f"train.out={tmp_path / 'run'}",
                "train.epochs=12",
                "mlflow.enabled=false",
                "model.dim=16",
                "loss.kind=sampled_softmax",
                "loss.num_negatives=16",
                "model.dropout=0",
                "optim.lr=0.01",
                "eval.best_metric=valid/full/ndcg@10",
            ],
        )
    )
    best = res["best"]
    assert best["metric"] == "valid/full/ndcg@10" and 0 < best["step"] < res["steps"]
    assert os.path.basename(os.path.dirname(res["checkpoint"])) == "best"
    assert checkpoint.read_meta(res["checkpoint"])["step"] == best["step"]
    assert best["last_checkpoint"] == checkpoint.latest(str(tmp_path / "run" / "checkpoints"))
    assert best["value"] == res["metrics"]["valid/full/ndcg@10"]
    last = checkpoint.load(best["last_checkpoint"])["model"]
    chosen = checkpoint.load(res["checkpoint"])["model"]
    assert any(not torch.equal(last[k], chosen[k]) for k in last)
    out = tmp_path / "metrics.json"  # the checkpoint result.json names is the model it scored
    got = _eval_cli(res["checkpoint"], shards, out)
    for k, v in res["metrics"].items():
        assert got[k] == pytest.approx(v, abs=1e-9), k
    # a metric that is not a validation metric: a clear error before or at the first validation
    with pytest.raises(Exception, match="eval.best_metric='test/full/hr@10' needs a validation metric"):
        load_config(None, [f"data.shards={shards}", "eval.best_metric=test/full/hr@10"])
    with pytest.raises(Exception, match="choose one of .*valid/full/ndcg@10"):
        train(
            load_config(
                None,
                [
                    f"data.shards={shards}",
                    f"train.out={tmp_path / 'bad'}",
                    "train.max_steps=13",
                    "mlflow.enabled=false",
                    "model.dim=16",
                    "eval.best_metric=valid/full/ndgc@10",
                ],
            )
        )


def _two_checkpoints(tmp_path) -> tuple[str, str]:
    root = str(tmp_path / "checkpoints")
    for step in (3, 6):
        checkpoint.save(root, {"model": {"w": torch.full((64,), float(step))}, "rng": torch.zeros(2)}, {"step": step})
    return checkpoint.step_dir(root, 3), checkpoint.step_dir(root, 6)


def test_a_checkpoint_records_and_verifies_every_files_sha256(tmp_path):
    _, newest = _two_checkpoints(tmp_path)
    files = checkpoint.read_meta(newest)["files"]
    size = os.path.getsize(os.path.join(newest, "state.pt"))
    assert set(files) == {"state.pt"} and files["state.pt"]["bytes"] == size  # one piece: the file's sha256
    assert [len(h) for h in files["state.pt"]["sha256"]] == [64]
    assert torch.equal(checkpoint.load(newest)["model"]["w"], torch.full((64,), 6.0))
    raw = bytearray(open(os.path.join(newest, "state.pt"), "rb").read())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit in the middle of the tensor bytes
    open(os.path.join(newest, "state.pt"), "wb").write(bytes(raw))
    with pytest.raises(checkpoint.CheckpointError, match="does not match the sha256"):
        checkpoint.load(newest)
    open(os.path.join(newest, "state.pt"), "wb").close()  # zero length
    with pytest.raises(checkpoint.CheckpointError, match="0 bytes now"):
        checkpoint.load(newest)


def test_resume_takes_the_newest_checkpoint_that_verifies_and_says_which_it_skipped(tmp_path):
    older, newest = _two_checkpoints(tmp_path)
    with open(os.path.join(newest, "state.pt"), "r+b") as f:
        f.seek(-3, 2)
        f.write(b"xyz")
    said = []
    assert checkpoint.latest_verified(str(tmp_path / "checkpoints"), said.append) == older
    assert len(said) == 1 and "step-00000006" in said[0] and "damaged" in said[0]
    os.remove(os.path.join(older, "state.pt"))
    assert checkpoint.latest_verified(str(tmp_path / "checkpoints"), said.append) is None


def test_a_warm_up_step_leaves_nothing_behind(shards, tmp_path):
    """The warm-up a rejoining group runs before its first quorum (Trainer.warm_up) changes
    nothing a later step sees: with dropout and sampled negatives on, three steps after it end
    bitwise where three steps without it end."""
    from training.train import Trainer

    runs = []
    for warm in (False, True):
        cfg = _cfg(shards, tmp_path / f"w{warm}")
        given = cfg.to_dict()
        tr = Trainer(cfg)
        # the trainer resolves against the shard set and the machine in a copy of its own
        assert cfg.to_dict() == given and (cfg.model.max_len, cfg.loss.kind) == (0, "auto")
        assert tr.cfg.model.max_len > 0 and tr.cfg.loss.kind != "auto"
        tr.model.train()
        if warm:
            tr.warm_up()
            assert all(p.grad is None for p in tr.params)
        for _ in range(3):
            assert tr.train_step()
        runs.append(tr.state.state_dict())
    _assert_same(runs[0], runs[1])
