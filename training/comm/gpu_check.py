"""`python -m training.comm.gpu_check`: the prepared GPU check of the CUDA claims (<= 5 min).

Never run here (no GPU): until it runs on a GPU machine, BENCHMARKS.md marks the CUDA path
of `smfree` as unverified. On one GPU or more it measures and checks:

 1. slowdown: a bf16 matmul loop on the compute stream, alone, then while the same bytes
    move on a side stream by (a) an SM kernel (an elementwise copy, the kind of kernel a
    communication library runs; plus NCCL all-reduce when >= 2 GPUs) and (b) the copy
    engines (cudaMemcpyAsync device->pinned host->device, and device->device).
 2. SM-free: the CUDA profiler sees no kernel, only memcpys, during an smfree all-to-all.
 3. correctness: 2 processes (gloo group for setup; one GPU each, or both on GPU 0)
    move CUDA tensors through make_transport("smfree", device="cuda"): uneven all-to-all
    and all-reduce equal the CPU collective's result bitwise, and a ShardedEmbedding on
    CUDA over smfree equals the CPU collective one (forward and gradients).

Prints a table and writes bench-results/gpu_check.json. Exit code 0 only if every check
passed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

BUDGET_S = float(os.environ.get("FTREC_GPU_CHECK_BUDGET_S", "270"))
ROOT = Path(__file__).resolve().parents[2]


def _matmul_time(n: int, size: int, side=None, side_stream=None) -> float:
    """Seconds for n matmuls on the default stream, with `side()` looping on side_stream."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    if side is not None:
        with torch.cuda.stream(side_stream):
            for _ in range(8):  # queue enough side work to cover the matmul loop
                side()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def check_slowdown(mbytes: int = 256, n: int = 200, size: int = 8192) -> dict:
    nel = mbytes * 2**20 // 4
    src = torch.randn(nel, device="cuda")
    dst = torch.empty_like(src)
    host = torch.empty(nel, pin_memory=True)
    s = torch.cuda.Stream()
    sides = {
        "none": None,
        "sm_copy_kernel": lambda: torch.mul(src, 1.0, out=dst),              # runs on SMs
        "copy_engine_d2h_h2d": lambda: (host.copy_(src, non_blocking=True), dst.copy_(host, non_blocking=True)),
        "copy_engine_d2d": lambda: dst.copy_(src, non_blocking=True),      # cudaMemcpyAsync
    }
    out = {}
    _matmul_time(5, size)  # warm-up
    for name, fn in sides.items():
        out[name] = _matmul_time(n, size, fn, s)
    base = out["none"]
    return {k: {"matmul_s": v, "slowdown": v / base} for k, v in out.items()}


def check_no_kernels() -> dict:
    """Count GPU kernels (not memcpys) the profiler sees during smfree all-to-alls (1 rank)."""
    from training.comm.spawn import run_ranks
    return run_ranks(_profile_worker, 1, timeout_s=120)[0]


def _profile_worker(rank, world_size):
    from torch.profiler import ProfilerActivity, profile

    from training.comm.transport import make_transport, TransportConfig
    torch.cuda.set_device(0)
    t = make_transport(TransportConfig(kind="smfree"), device="cuda")
    x = torch.randn(1 << 20, device="cuda")
    t.all_to_all(x, [x.shape[0]], [x.shape[0]]).wait()  # warm-up, pins the outbox
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        y = t.all_to_all(x, [x.shape[0]], [x.shape[0]]).wait()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    kernels = [n for n in names if "memcpy" not in n.lower() and "memset" not in n.lower()]
    ok = torch.equal(x, y)
    t.close()
    return {"transport": t.name, "gpu_events": len(names), "kernels": sorted(set(kernels)), "equal": ok}


def _correct_worker(rank, world_size):
    import torch.distributed as dist
    from training.comm.sharded_embedding import ShardedEmbedding
    from training.comm.transport import make_transport, TransportConfig
    dev = f"cuda:{rank % torch.cuda.device_count()}"
    torch.cuda.set_device(dev)
    cpu = make_transport("collective")
    gpu = make_transport(TransportConfig(kind="smfree"), device=dev)
    fails = []
    if gpu.name != "smfree":
        fails.append(f"smfree fell back: {getattr(gpu, 'fallback_reason', '')}")
    g = torch.Generator().manual_seed(rank)
    m = torch.tensor([[3, 700], [5000, 0]])
    send = torch.randn(int(m[rank].sum()), 64, generator=g)
    a = cpu.all_to_all(send, m[rank].tolist(), m[:, rank].tolist()).wait()
    b = gpu.all_to_all(send.to(dev), m[rank].tolist(), m[:, rank].tolist()).wait()
    if not torch.equal(a, b.cpu()):
        fails.append("all_to_all differs")
    r = torch.randn(10000, generator=g)
    ra = cpu.all_reduce(r.clone()).wait()
    rb = gpu.all_reduce(r.clone().to(dev)).wait()
    if not torch.equal(ra, rb.cpu()):
        fails.append("all_reduce differs")
    ids = torch.randint(0, 1000, (64, 20), generator=g)
    up = torch.randn(64, 20, 32, generator=g)
    e_cpu = ShardedEmbedding(1000, 32, cpu, seed=3)
    e_gpu = ShardedEmbedding(1000, 32, gpu, seed=3).to(dev)
    o1 = e_cpu(ids)
    (o1 * up).sum().backward()
    o2 = e_gpu(ids.to(dev))
    (o2 * up.to(dev)).sum().backward()
    if not torch.equal(o1, o2.cpu()):
        fails.append("sharded forward differs")
    if not torch.allclose(e_cpu.weight.grad, e_gpu.weight.grad.cpu(), rtol=1e-5, atol=1e-6):
        fails.append("sharded grad differs beyond float tolerance")  # GPU kernels may sum in another order
    dist.barrier()
    gpu.close()
    return fails


def check_correctness() -> list:
    from training.comm.spawn import run_ranks
    return run_ranks(_correct_worker, 2, timeout_s=150)


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device in this process; run it on a GPU machine", file=sys.stderr)
        return 2
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__}
    ok = True
    steps = [("slowdown", check_slowdown), ("no_kernels", check_no_kernels), ("correctness", check_correctness)]
    for name, fn in steps:
        if time.time() - t0 > BUDGET_S:
            res[name] = "skipped: time budget spent"
            ok = False
            continue
        try:
            res[name] = fn()
        except Exception as e:  # report and go on: one failed part must not hide the others
            res[name] = f"error: {type(e).__name__}: {e}"
            ok = False
    if isinstance(res.get("no_kernels"), dict):
        ok &= res["no_kernels"]["kernels"] == [] and res["no_kernels"]["equal"]
    if isinstance(res.get("correctness"), list):
        ok &= all(f == [] for f in res["correctness"])
    res["ok"], res["wall_s"] = bool(ok), time.time() - t0
    if isinstance(res.get("slowdown"), dict):
        print(f"{'side traffic':24s} matmul s   slowdown")
        for k, v in res["slowdown"].items():
            print(f"{k:24s} {v['matmul_s']:.3f}     {v['slowdown']:.3f}")
    print(json.dumps({k: v for k, v in res.items() if k != "slowdown"}, indent=1, default=str))
    out = ROOT / "bench-results" / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
