"""Run a function on W real gloo ranks (one process each) on this host, bounded by a timeout:
the comm tests, the comm benchmark and the GPU check (nothing the wheel ships).

Every process is ended by its own PID when the time is up or a rank fails; results come
back over a local multiprocessing queue.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ftcore import collectives as coll
from ftcore.util.procs import free_port


def _entry(fn, rank, world_size, port, q, args, timeout_s, backend="gloo", setup=None):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if setup is not None:
            setup(rank)  # e.g. register a backend, pick the rank's GPU
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timeout
        )
        coll.setup_default(timeout=timeout)  # a device backend gets its gloo twin
        # plain pickle to bytes: tensors travel by value, not as shared-memory handles
        # that die with this process
        q.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


class RanksFailed(RuntimeError):
    pass


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120.0, backend: str = "gloo", setup=None) -> list:
    """fn(rank, world_size, *args) on each rank (fn must be importable); returns the results
    in rank order. Raises RanksFailed with the failing rank's traceback, or on timeout.
    `backend`: the default group's; `setup(rank)` (importable) runs first in each rank."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, q, args, timeout_s, backend, setup), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RanksFailed(
                    f"ranks {sorted(set(range(world_size)) - set(results))} did not finish within {timeout_s:.0f}s"
                )
            try:
                rank, ok, value = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RanksFailed(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}") from None
                continue
            if not ok:
                raise RanksFailed(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)  # from our own child over a local pipe
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive() and p.pid is not None:  # alive: started, so it has a pid
                os.kill(p.pid, 9)
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]
