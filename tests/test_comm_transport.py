"""Transport: `collective` and `smfree` give bitwise equal results on real gloo ranks,
smfree falls back to collective (with the reason) when it cannot run."""

import os

import pytest
import torch
import torch.distributed as dist

from benchmarks.spawn import run_ranks
from training.comm.transport import TransportConfig, make_transport

pytestmark = pytest.mark.integ


def _ops(rank, world_size, seed):
    """Uneven all-to-alls of several dtypes/shapes, growing past the outbox, and all-reduces."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    cases = []
    for i, (dtype, tail) in enumerate(
        [(torch.float32, (16,)), (torch.int64, ()), (torch.float32, (3, 5)), (torch.float32, (1024,))]
    ):
        # split sizes: every rank knows the matrix (derived from the seed), zero splits included
        m = torch.randint(0, 300, (world_size, world_size), generator=torch.Generator().manual_seed(seed + i))
        m[0, world_size - 1] = 0
        send_splits, recv_splits = m[rank].tolist(), m[:, rank].tolist()
        send = (torch.randn(sum(send_splits), *tail, generator=g) * 1e3).to(dtype)
        cases.append((send, send_splits, recv_splits))
    red = [torch.randn(1000, generator=g), torch.randn(7, 3, generator=g).double()]
    return cases, red


def _run(rank, world_size, kind, seed, shm_dir):
    t = make_transport(TransportConfig(kind=kind, shm_dir=shm_dir, initial_capacity=4096))
    cases, red = _ops(rank, world_size, seed)
    # issue everything before waiting: ops must still complete in issue order
    handles = [t.all_to_all(*c) for c in cases] + [t.all_reduce(x) for x in red]
    out = [h.wait() for h in handles]
    files = sorted(os.listdir(shm_dir)) if kind == "smfree" else []
    name = t.name
    dist.barrier()
    t.close()
    dist.barrier()
    left = [f for f in os.listdir(shm_dir) if f.startswith("ftrec-")] if kind == "smfree" else []
    return name, out, files, left


def _both(rank, world_size, seed, shm_dir):
    return [_run(rank, world_size, kind, seed, shm_dir) for kind in ("collective", "smfree")]


def test_smfree_equals_collective(tmp_path):
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    before = {f for f in os.listdir(shm) if f.startswith("ftrec-")}
    per_rank = run_ranks(_both, 2, 3, shm, timeout_s=90)  # one pair of processes
    coll, sm = [r[0] for r in per_rank], [r[1] for r in per_rank]
    for r in range(2):
        assert coll[r][0] == "collective" and sm[r][0] == "smfree"
        assert len(coll[r][1]) == len(sm[r][1]) == 6
        for a, b in zip(coll[r][1], sm[r][1], strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b)
        assert any("box" in f for f in sm[r][2]), "smfree must have used shared-memory outboxes"
    # the rows each rank received are the ones its peers sent it
    cases0, _ = _ops(0, 2, 3)
    cases1, _ = _ops(1, 2, 3)
    send, splits, _ = cases1[0]
    assert torch.equal(sm[0][1][0][-splits[0] :] if splits[0] else sm[0][1][0][:0], send[: splits[0]])
    # all-reduce is the sum on both ranks
    _, red0 = _ops(0, 2, 3)
    _, red1 = _ops(1, 2, 3)
    assert torch.equal(sm[0][1][4], red0[0] + red1[0]) and torch.equal(sm[1][1][4], sm[0][1][4])
    # closed transports leave no files behind
    assert {f for f in sm[0][3]} - before == set()


def _fallback(rank, world_size, mode, tmp):
    device = "cpu"
    if mode == "hosts":
        cfg = TransportConfig(kind="smfree", shm_dir="/dev/shm", host_id=f"host-{rank}")
    elif mode == "no_cuda":  # CUDA tensors asked for, no CUDA here: no copy-engine path
        cfg, device = TransportConfig(kind="smfree"), "cuda"
    else:
        cfg = TransportConfig(kind="smfree", shm_dir=os.path.join(tmp, "missing") if rank == 1 else "/dev/shm")
    t = make_transport(cfg, device=device)
    x = torch.arange(4.0) + rank
    y = t.all_reduce(x).wait()
    a2a = t.all_to_all(torch.tensor([rank * 10, rank * 10 + 1]), [1, 1], [1, 1]).wait()
    t.close()
    return type(t).__name__, getattr(t, "fallback_reason", ""), y, a2a


MODES = ["hosts", "no_shm", "no_cuda"]


def _fallbacks(rank, world_size, tmp):
    return [_fallback(rank, world_size, m, tmp) for m in MODES]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_fallback_to_collective(tmp_path):
    per_rank = run_ranks(_fallbacks, 2, str(tmp_path), timeout_s=90)  # one pair of processes
    for i, mode in enumerate(MODES):
        _check_fallback(mode, [per_rank[0][i], per_rank[1][i]])


def _check_fallback(mode, res):
    for name, reason, y, _a2a in res:
        assert name == "CollectiveTransport"  # every rank takes the same decision
        expect = {"hosts": "different hosts", "no_shm": "missing or not writable", "no_cuda": "CUDA is not available"}
        assert expect[mode] in reason
        assert torch.equal(y, torch.tensor([1.0, 3.0, 5.0, 7.0]))
    assert res[0][3].tolist() == [0, 10] and res[1][3].tolist() == [1, 11]


def test_unknown_kind_is_a_config_error():
    with pytest.raises(ValueError, match="comm.transport"):
        make_transport(TransportConfig(kind="nvlink"))


def _dies(rank, world_size):
    make_transport(TransportConfig(kind="smfree"))
    dist.barrier()
    if rank == 1:
        raise RuntimeError("rank 1 fails without closing its transport")
    return "ok"


def test_a_failing_rank_leaves_no_shared_memory():
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(Exception, match="rank 1 fails"):
        run_ranks(_dies, 2, timeout_s=60)
    left = {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("ftrec-")}
    assert left == set()


def test_a_killed_ranks_segments_are_swept_and_a_live_ones_are_kept(tmp_path):
    """kill -9 runs no cleanup; the kernel drops the creator's lock, which `sweep` reads."""
    import signal
    import subprocess
    import sys

    from training.comm import shm

    live = shm.create(str(tmp_path / "ftrec-live-ctrl-0"), 64)
    code = (
        "import os, signal, sys; from training.comm import shm; "
        "shm.create(sys.argv[1], 4096); os.kill(os.getpid(), signal.SIGKILL)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "ftrec-dead-box-1-0")],
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))},
    )
    assert r.returncode == -signal.SIGKILL
    (tmp_path / "unrelated.bin").write_bytes(b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ftrec-dead-box-1-0", "ftrec-live-ctrl-0", "unrelated.bin"]
    assert shm.sweep(str(tmp_path)) == ["ftrec-dead-box-1-0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ftrec-live-ctrl-0", "unrelated.bin"]
    os.close(live)
    assert shm.sweep(str(tmp_path)) == ["ftrec-live-ctrl-0"]
