"""The device rule on a CPU machine: every collective of ftcore and training goes through
ftcore/collectives.py, which puts data on the group's device and control values on a CPU
gloo twin. Two ranks whose default group is the test device backend (tests/device_rule.py:
it takes only tensors the layer placed as data, as NCCL takes only GPU tensors, and records
every call) run FTAR over a device cross-group group, the group vote and incarnation, the
comm metrics, the sharded item table and a few steps of the real trainer with it. Any
control value sent to a device group is refused and recorded, also where the caller
swallows the error (the vote would just say no), and fails the test here.
"""

import datetime
import os
import types

import device_rule
import pytest
import torch
import torch.distributed as dist

from benchmarks.spawn import free_port, run_ranks
from dataprep.build import build_shards
from dataprep.synth import write_synthetic
from ftcore import collectives as coll

pytestmark = pytest.mark.integ


def _run(name, fn, out):
    n_rej, n_calls = len(device_rule.REJECTED), len(device_rule.CALLS)
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        value = f"error: {type(e).__name__}: {e}"
    out[name] = {"value": value, "rejected": device_rule.REJECTED[n_rej:], "calls": device_rule.CALLS[n_calls:]}


def _sanity(rank):
    dist.all_reduce(torch.ones(1))  # around the layer: must be refused
    return "accepted"


def _ftcore(rank, port):
    from ftcore.crossgroup import new_pg as _new_pg
    from ftcore.ftar import ftar, plan
    from ftcore.manager import Manager, agree_incarnation

    inc = agree_incarnation(dist.group.WORLD)
    stub = types.SimpleNamespace(cfg=types.SimpleNamespace(world=2), _group_pg=dist.group.WORLD, _errors=[])
    votes = [Manager._group_vote(stub, True, 7), Manager._group_vote(stub, rank == 1, 7)]
    # the two ranks as two replica groups, over a cross-group group of the device backend
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    pg = _new_pg(device_rule.NAME, dist.PrefixStore("ftar", store), rank, 2, datetime.timedelta(seconds=30))
    big, small = torch.full((300_000,), float(rank + 1)), torch.full((3, 2), 10.0 * (rank + 1))
    r1 = ftar(pg, [big, small], contribute=True, step=3, bucket_bytes=1 << 18)
    # the staged path (CUDA gradients over gloo), with the CPU stand-in of the copy engines
    a = torch.full((1000,), float(rank + 2))
    r2 = ftar(pg, [a], contribute=rank == 0, step=4, stage=coll.HostStage(torch.device("cpu")))
    ok = (
        torch.equal(big, torch.full((300_000,), 1.5))
        and torch.equal(small, torch.full((3, 2), 15.0))
        and torch.equal(a, torch.full((1000,), 2.0))
    )
    return {
        "incarnation": inc,
        "votes": votes,
        "contributors": [r1.contributors, r2.contributors],
        "averaged": ok,
        "buckets": len(plan([big, small], 1 << 18)) + 1,
    }


def _metrics(rank, out_dir):
    from training import loss, metrics
    from training.comm.config import CommConfig
    from training.comm.integration import GroupComm

    gc = GroupComm(CommConfig(transport="collective"), rank=rank)
    w = torch.nn.Parameter(torch.ones(8))
    window = metrics.Window()
    for step in range(3):
        gc.step_begin(step)
        counts, pending = loss.start_global_counts([10.0 + rank, 2.0, 30.0])
        with gc.compute("forward_backward"):
            (w * (rank + 1)).sum().backward()
        pending.wait()
        gc.allreduce_grads([w])  # the transport's data path, on the comm thread
        gc.step_end()
        window.record(step, 0.5, 0.1, 0.01, 0.001, 0.02, 0.0, float(counts[1]), float(counts[0]), float(counts[2]))
        w.grad = None
    per_rank, stop, proposal = metrics.gather_times(window, rank == 1, 2.5)
    m = gc.window_metrics()
    png = gc.finish(out_dir)
    return {
        "counts": counts.tolist(),
        "stop": stop,
        "proposal": proposal,
        "ranks": per_rank.shape[0],
        "metrics": sorted(m),
        "png": png is not None or rank != 0,
    }


def _table(rank):
    from training.comm.item_table import ShardedItemTable, grad_norm_sq
    from training.comm.scheduler import CommScheduler
    from training.comm.sharded_embedding import reference_weight
    from training.comm.transport import make_transport

    full = reference_weight(61, 4, seed=3, padding_idx=0)
    table = ShardedItemTable(full, make_transport("collective", group=coll.new_group()), CommScheduler("prioritized"))
    g = torch.Generator().manual_seed(rank)
    ids = [
        torch.randint(0, 61, (7 + rank,), generator=g),
        torch.randint(1, 61, (7 + rank,), generator=g),
        torch.randint(1, 61, (5,), generator=g),
    ]
    nxt = [torch.randint(0, 61, (6,), generator=g), torch.randint(1, 61, (6,), generator=g)]
    table.start_step(0, ids, 1, nxt)
    rows = [table(t) for t in ids]
    sum(r.sum() for r in rows).backward()
    table.start_grads()
    table.finish_grads()
    norm = float(grad_norm_sq(table.weight))
    same = all(torch.equal(r.detach(), full[t]) for r, t in zip(rows, ids, strict=True))
    smfree = make_transport("smfree", group=coll.new_group())  # setup facts and barrier: control
    got = smfree.all_to_all(torch.arange(4.0) + 10 * rank, [2, 2], [2, 2]).wait().tolist()
    coll.barrier(smfree.group)  # both read before either unlinks its outbox
    smfree.close()
    return {"rows_equal": same, "norm": norm, "full_equal": torch.equal(table.full_weight(), full), "smfree": got}


def _trainer(rank, shards, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    from training.config import load_config
    from training.train import train

    res = train(
        load_config(
            None,
            [
                f"data.shards={shards}",
                f"train.out={out}",
                "train.max_steps=4",
                "train.log_every=2",
                "model.dim=16",
                "mlflow.enabled=false",
                "eval.periodic=false",
                "eval.final=false",
                "comm.embedding=sharded",
                "optim.grad_clip=1.0",
                "train.checkpoint_every=2",
            ],
        )
    )
    return {"steps": res.get("steps") if rank == 0 else 4}


def _all(rank, world_size, port, shards, out):
    res = {}
    _run("sanity", lambda: _sanity(rank), res)
    _run("ftcore", lambda: _ftcore(rank, port), res)
    _run("metrics", lambda: _metrics(rank, os.path.join(out, "metrics")), res)
    _run("table", lambda: _table(rank), res)
    _run("trainer", lambda: _trainer(rank, shards, os.path.join(out, "train")), res)
    return res


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("device_rule")
    write_synthetic(str(d / "ev.txt"), users=120, items=60, seed=5, median_len=8, max_history=30)
    build_shards(str(d / "ev.txt"), "sasrec", str(d / "shards"), world_size=2, batch_size=8, max_len=20)
    return run_ranks(
        _all,
        2,
        free_port(),
        str(d / "shards"),
        str(d),
        timeout_s=400,
        backend=device_rule.NAME,
        setup=device_rule.setup,
    )


def _clean(ranks, part):
    for r in ranks:
        assert r[part]["rejected"] == [], r[part]["rejected"]
        assert not str(r[part]["value"]).startswith("error"), r[part]["value"]
    return [r[part] for r in ranks]


def _data_ops(part) -> list[str]:
    return [c["op"] for c in part["calls"]]


def test_the_test_backend_refuses_a_collective_around_the_layer(ranks):
    for r in ranks:
        assert r["sanity"]["value"].startswith("error") and len(r["sanity"]["rejected"]) == 1


def test_ftar_vote_and_incarnation_send_control_values_to_the_gloo_twin(ranks):
    a, b = _clean(ranks, "ftcore")
    assert a["value"]["incarnation"] == b["value"]["incarnation"]
    assert a["value"]["votes"] == b["value"]["votes"] == [True, False]
    assert a["value"]["contributors"] == [2, 1] and a["value"]["averaged"] and b["value"]["averaged"]
    # the device group saw the buckets only: no head, no tail, no vote, no incarnation
    assert _data_ops(a) == ["allreduce"] * a["value"]["buckets"]


def test_comm_metrics_counts_and_timings_stay_off_the_device_group(ranks):
    a, b = _clean(ranks, "metrics")
    assert a["value"]["counts"] == [21.0, 4.0, 60.0] and a["value"]["stop"] and a["value"]["proposal"] == 2.5
    assert "comm/bubble_fraction" in a["value"]["metrics"] and a["value"]["png"]
    assert _data_ops(a) == ["allreduce"] * 3  # the gradients, through the transport


def test_sharded_item_table_ids_rows_and_grads_are_data_split_sizes_control(ranks):
    a, b = _clean(ranks, "table")
    for r in (a, b):
        assert r["value"]["rows_equal"] and r["value"]["full_equal"] and r["value"]["norm"] > 0
    assert a["value"]["smfree"] == [0.0, 1.0, 10.0, 11.0]
    ops = _data_ops(a)
    assert "alltoall_base" in ops and "allgather" in ops and "allreduce" in ops
    assert all(c["ok"] for c in a["calls"])


def test_the_trainer_with_a_sharded_table_on_a_device_backend(ranks):
    a, b = _clean(ranks, "trainer")
    assert a["value"]["steps"] == 4
    ops = set(_data_ops(a))
    assert {"allreduce", "broadcast", "alltoall_base", "allgather"} <= ops
