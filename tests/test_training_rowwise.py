"""optim.item_optimizer = "rowwise_adam": Adam on the rows a step touched, the table's
gradient carried as rows (training/rows.py) inside the group and across replica groups.

Units: the optimizer against torch's AdamW (bitwise when every row is touched; lazy
otherwise), its state through state_dict, the slot packing against an FTAR-style average,
the rows bound against every real step. Integration: 2 gloo ranks resume exactly; 2 replica
groups on ftcore with one killed and healed end bitwise identical, every batch once."""

import copy
import json
import re

import pytest
import torch
from conftest import cli_shard_set, run_launch, shard_sample_ids, synthetic_shards, torchrun_train

from dataprep import schema
from ftcore import ledger
from training import checkpoint, rows
from training.data import ShardSet, read_batch, shard_ranks_for
from training.state import RowwiseAdamW


def _pair(lr: float = 1e-2):
    torch.manual_seed(0)
    w = torch.randn(12, 4)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    groups = lambda p: [{"params": [p], "lr": lr, "weight_decay": 0.0}]  # noqa: E731
    return a, b, torch.optim.AdamW(groups(a), betas=(0.9, 0.98)), RowwiseAdamW(groups(b), betas=(0.9, 0.98))


def _sparse(ids: list[int], values: torch.Tensor, shape) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([ids]), values, shape, check_invariants=True).coalesce()


def test_rowwise_adam_equals_adam_when_every_row_is_touched():
    a, b, oa, ob = _pair()
    for _ in range(5):
        g = torch.randn(12, 4)
        a.grad, b.grad = g.clone(), g.to_sparse(1)
        oa.step()
        ob.step()
        assert torch.equal(a, b)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(oa.state[a][key], ob.state[b][key]), key


def test_rowwise_adam_moves_only_the_touched_rows():
    """Lazy Adam: a row absent from a step keeps its weight and its moments (dense Adam would
    move it on its momentum); a touched row moves as Adam moves it."""
    a, b, oa, ob = _pair()
    g = torch.randn(12, 4)
    a.grad, b.grad = g.clone(), g.to_sparse(1)
    oa.step()
    ob.step()  # step 1: every row
    before, m_before = b.detach().clone(), ob.state[b]["exp_avg"].clone()
    g2 = torch.randn(2, 4)
    b.grad = _sparse([3, 7], g2, (12, 4))
    ob.step()
    untouched = [i for i in range(12) if i not in (3, 7)]
    assert torch.equal(b[untouched], before[untouched])
    assert torch.equal(ob.state[b]["exp_avg"][untouched], m_before[untouched])
    assert not torch.equal(b[[3, 7]], before[[3, 7]])
    dense = torch.zeros(12, 4)
    dense[[3, 7]] = g2
    a.grad = dense
    oa.step()  # dense Adam moves the untouched rows too
    assert not torch.equal(a[untouched], before[untouched])


def test_rowwise_adam_state_dict_resumes_bitwise():
    grads = [(torch.randint(0, 12, (5,)).unique().tolist(), None) for _ in range(6)]
    torch.manual_seed(1)
    grads = [(ids, torch.randn(len(ids), 4)) for ids, _ in grads]
    _, b, _, ob = _pair()
    _, c, _, oc = _pair()
    for i, (ids, v) in enumerate(grads):
        b.grad = _sparse(ids, v, (12, 4))
        ob.step()
        if i == 2:  # a fresh optimizer (and weights) from the state after step 3, as a heal would
            with torch.no_grad():
                c.copy_(b)
            oc.load_state_dict(copy.deepcopy(ob.state_dict()))  # a heal ships copies
        elif i > 2:
            c.grad = _sparse(ids, v, (12, 4))
            oc.step()
    assert torch.equal(b, c)
    assert all(torch.equal(ob.state[b][k], oc.state[c][k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def test_slots_average_like_ftar():
    """3 groups, group 1 not contributing (healing: FTAR zeroes its tensors): SUM / 2 of the
    slot buffers unpacks to the average of the two contributors' rows, the same on each group."""
    torch.manual_seed(2)
    g0 = (torch.tensor([2, 5, 9]), torch.randn(3, 4))
    g2 = (torch.tensor([5, 11]), torch.randn(2, 4))
    bufs = [rows.pack(*g0, 0, 3, 6), rows.pack(*g0, 1, 3, 6), rows.pack(*g2, 2, 3, 6)]
    for t in bufs[1]:
        t.zero_()
    avg = [sum(b[i] for b in bufs) / 2 for i in range(2)]
    ids, got = rows.unpack(*avg)
    assert ids.tolist() == [2, 5, 9, 11]
    dense = torch.zeros(12, 4)
    dense[g0[0]] += g0[1]
    dense[g2[0]] += g2[1]
    assert torch.allclose(got, (dense / 2)[ids], atol=1e-7)
    again = rows.unpack(*[t.clone() for t in avg])
    assert torch.equal(again[1], got)  # every group unpacks the same buffers the same way
    with pytest.raises(RuntimeError, match="more than the bound 2"):
        rows.pack(*g0, 0, 3, 2)
    local = (torch.tensor([0, 4]), torch.ones(2, 4))  # a shard's row 0 is a real row
    assert rows.unpack(*rows.pack(*local, 0, 1, 3))[0].tolist() == [0, 4]


def test_rows_bound_covers_every_step(tmp_path):
    """The bound from the Parquet metadata is >= the rows any group touches in any step."""
    shards = ShardSet(
        str(synthetic_shards(tmp_path, users=200, items=2000, seed=5, world_size=4, batch_size=8, max_len=20))
    )
    groups, k = 2, 2
    reads = [[r for i in range(k) for r in shard_ranks_for(4, groups, g, k, i)] for g in range(groups)]
    bound = rows.rows_bound(rows.shard_step_counts(shards), reads, (0, 16), shards.num_items)
    most = 0
    for ranks in reads:
        files = [shards.open_rank(r) for r in ranks]
        for step in range(shards.steps):
            b = read_batch(files, step)
            most = max(most, torch.cat([b.values, b.labels]).unique().numel() + 16)
    assert most <= bound < shards.num_items


SETTINGS = [
    "loss.kind=sampled_softmax",  # one loss for both tables (auto: softmax on a replicated one only)
    "model.dropout=0",
    "model.dim=16",
    "train.log_every=1",
    "mlflow.enabled=false",
    "optim.warmup_steps=2",
    "eval.periodic=false",
    "loss.kind=sampled_softmax",
    "loss.num_negatives=16",
    "optim.item_optimizer=rowwise_adam",
    "train.max_steps=8",
]


@pytest.mark.integ
def test_two_ranks_rowwise_resume_is_exact(tmp_path, free_port):
    """2 gloo ranks: stop at 4 and resume to 8 = one run of 8 (weights and optimizer state)."""
    shards = str(synthetic_shards(tmp_path, users=200, items=90, seed=5, world_size=2, batch_size=8, max_len=20))
    whole = torchrun_train(shards, str(tmp_path / "whole"), free_port, SETTINGS)
    torchrun_train(shards, str(tmp_path / "split"), free_port, [*SETTINGS, "train.stop_at_step=4"])
    resumed = torchrun_train(shards, str(tmp_path / "split"), free_port, [*SETTINGS, "train.resume=true"])
    assert "loss" in whole and "Traceback" not in resumed
    a = checkpoint.load(json.load(open(tmp_path / "whole" / "result.json"))["checkpoint"])
    b = checkpoint.load(json.load(open(tmp_path / "split" / "result.json"))["checkpoint"])
    for name, w in a["model"].items():
        assert torch.equal(w, b["model"][name]), name
    for i, st in a["optimizer"]["state"].items():
        assert all(torch.equal(v, b["optimizer"]["state"][i][k]) for k, v in st.items()), i


@pytest.mark.integ
def test_sharded_rowwise_trains_like_replicated_rowwise_and_resumes_exactly(tmp_path, free_port):
    """comm.embedding=sharded under rowwise_adam: each shard keeps the rows its peers sent
    (Adam on those only); the same run as the replicated table up to the order of float
    additions, and a stop at 4 / resume to 8 gives bitwise the run of 8."""
    shards = str(synthetic_shards(tmp_path, users=200, items=90, seed=5, world_size=2, batch_size=8, max_len=20))
    rep = torchrun_train(shards, str(tmp_path / "rep"), free_port, [*SETTINGS, "optim.grad_clip=0"])
    sharded = [*SETTINGS, "optim.grad_clip=0", "comm.embedding=sharded"]
    shd = torchrun_train(shards, str(tmp_path / "shd"), free_port, sharded)
    assert "item table sharded row-wise over 2 ranks" in shd
    assert re.findall(r"loss (\S+)", shd) == re.findall(r"loss (\S+)", rep)
    a = checkpoint.load(json.load(open(tmp_path / "rep" / "result.json"))["checkpoint"])["model"]
    b = checkpoint.load(json.load(open(tmp_path / "shd" / "result.json"))["checkpoint"])["model"]
    for name, w in a.items():
        if name.endswith("qkv.bias"):  # the key bias: a zero true gradient, Adam amplifies float noise
            d = w.numel() // 3
            w, b[name] = torch.cat([w[:d], w[2 * d :]]), torch.cat([b[name][:d], b[name][2 * d :]])
        assert torch.allclose(w, b[name], atol=1e-6, rtol=1e-5), name
    torchrun_train(shards, str(tmp_path / "split"), free_port, [*sharded, "train.stop_at_step=4"])
    torchrun_train(shards, str(tmp_path / "split"), free_port, [*sharded, "train.resume=true"])
    whole = checkpoint.load(
        json.load(open(tmp_path / "shd" / "result.json"))["checkpoint"], 1, per_rank=("rng", "optimizer")
    )
    split = checkpoint.load(
        json.load(open(tmp_path / "split" / "result.json"))["checkpoint"], 1, per_rank=("rng", "optimizer")
    )
    for i, st in whole["optimizer"]["state"].items():  # rank 1's shard: weights' moments, bitwise
        assert all(torch.equal(v, split["optimizer"]["state"][i][k]) for k, v in st.items()), i
    c = checkpoint.load(json.load(open(tmp_path / "split" / "result.json"))["checkpoint"])["model"]
    d = checkpoint.load(json.load(open(tmp_path / "shd" / "result.json"))["checkpoint"])["model"]
    assert all(torch.equal(w, c[k]) for k, w in d.items())


@pytest.mark.integ
@pytest.mark.slow
def test_rowwise_kill9_heal_identical_states_exactly_once(tmp_path):
    """The rows cross groups in FTAR slots: a killed group heals and ends bitwise identical."""
    shards, out = cli_shard_set(tmp_path), tmp_path / "run"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"kind": "kill", "group": 1, "at_step": 6}]}))
    settings = [
        "train.epochs=2",
        "model.dim=16",
        "loss.kind=sampled_softmax",
        "loss.num_negatives=16",
        "mlflow.enabled=false",
    ]
    settings += ["optim.item_optimizer=rowwise_adam", "eval.batch_size=256"]
    r = run_launch(out, 260, shards=shards, faults=plan, timeout=220, worker_args=["--set", *settings])
    assert r.returncode == 0, r.stdout[-5000:]
    assert (out / "replica_0" / "state.safetensors").read_bytes() == (
        out / "replica_1" / "state.safetensors"
    ).read_bytes()
    steps = json.loads((shards / schema.MANIFEST).read_text())["steps"]
    summary = ledger.check(
        str(out / "ledger"),
        steps_per_epoch=steps,
        num_groups=2,
        ranks_per_group=1,
        epochs=2,
        sample_ids=shard_sample_ids(shards),
    )
    assert summary["batches"] == 2 * 2 * steps and summary["makeup_steps"] >= 1
    assert json.loads((out / "timeline.json").read_text())["restarts"]["1"] == 1
