"""The replica group's processes: torch.distributed set-up and the gradient all-reduce.

Under torchrun the ranks of ONE replica group form the default process group (gloo on CPU,
nccl on CUDA, a gloo twin for control values); across groups training/replica.py averages.
FTREC_REPLICA_GROUP and FTREC_NUM_REPLICA_GROUPS name this process's group. Collectives
are bounded by FTREC_COLLECTIVE_TIMEOUT_S (300 s): a hung peer ends its group.
"""

import datetime
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ftcore import collectives as coll
from ftcore import netaddr, timeouts
from training.config import ConfigError

COLLECTIVE_TIMEOUT_S = timeouts.GROUP_COLLECTIVE_TIMEOUT  # FTREC_COLLECTIVE_TIMEOUT_S (ftcore/timeouts.py)
TRUE = ("1", "true", "yes")


@dataclass
class Topology:
    rank: int  # k: rank within the replica group
    group_size: int  # K
    replica_group: int  # g
    num_replica_groups: int  # R
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def as_params(self) -> dict:
        return {
            "topology.ranks_per_group": self.group_size,
            "topology.replica_groups": self.num_replica_groups,
            "topology.backend": dist.get_backend() if dist.is_initialized() else "none",
            "topology.device": str(self.device),
        }


def log(topo: Topology, msg: str) -> None:
    """One line from the group's rank 0, tagged with its replica group."""
    if topo.is_main:
        print(f"[train g{topo.replica_group}] {msg}", flush=True)


def _listen_where_ftcore_does() -> dist.Store | None:
    """gloo and the group's rendezvous store listen on the rank's one address (FTCORE_HOST or
    derived, ftcore/netaddr.py), not wherever the host name resolves, nor on every interface.

    Under torchrun the agent hosts the store (TORCHELASTIC_USE_AGENT_STORE): None, use it."""
    env = os.environ
    ref = env.get("FTCORE_LIGHTHOUSE") or f"{env.get('MASTER_ADDR', '127.0.0.1')}:0"
    host = netaddr.rank_host(ref)
    if not env.get("GLOO_SOCKET_IFNAME"):
        ifname = netaddr.interface_of(host)
        if ifname:
            env["GLOO_SOCKET_IFNAME"] = ifname
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or "MASTER_PORT" not in env:
        return None
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"])
    if int(env.get("RANK", "0")) == 0:
        fd, _ = netaddr.listen_fd(addr, port)
        return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=fd)
    return dist.TCPStore(addr, port, is_master=False, wait_for_workers=False, timeout=timeout)


def rank_device(env=os.environ, device_count: int | None = None) -> torch.device:
    """This rank's device: CPU without CUDA; else its own GPU, LOCAL_RANK within its replica
    group's GPUs on this host. The local launcher runs FTREC_GPU_SLOTS groups here and tells
    each its slot (FTREC_GPU_SLOT), so group s takes GPUs s*K .. s*K+K-1; under torchrun on a
    cluster (no slots) it is torchrun's LOCAL_RANK. Fewer GPUs than ranks is refused, unless
    FTREC_OVERSUBSCRIBE_GPUS=1 lets groups share them (never two ranks of one group: NCCL
    refuses two ranks on one GPU)."""
    if device_count is None:
        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_count == 0:
        return torch.device("cpu")
    local, per_group = int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "1"))
    slot, slots = int(env.get("FTREC_GPU_SLOT", "0")), int(env.get("FTREC_GPU_SLOTS", "1"))
    need = slots * per_group
    if per_group > device_count:
        raise ConfigError(
            f"{per_group} ranks per replica group need {per_group} GPUs on this host, {device_count} "
            "visible: NCCL cannot put two ranks of one group on one GPU; use fewer ranks per group"
        )
    if need > device_count and env.get("FTREC_OVERSUBSCRIBE_GPUS", "").lower() not in TRUE:
        raise ConfigError(
            f"{slots} replica group(s) x {per_group} rank(s) on this host need {need} GPUs, "
            f"{device_count} visible; run fewer groups here (launch --groups) or let groups share "
            "GPUs (launch --oversubscribe-gpus, FTREC_OVERSUBSCRIBE_GPUS=1)"
        )
    return torch.device("cuda", (slot * per_group + local) % device_count)


def init() -> Topology:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if world > 1 and not dist.is_initialized():
        store = _listen_where_ftcore_does()
        kw: dict[str, Any] = {"store": store, "rank": rank, "world_size": world} if store is not None else {}
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            # the watchdog ends this process when a collective hangs past `timeout`: the group restarts
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            kw["device_id"] = device
        dist.init_process_group(backend, timeout=timeout, **kw)
    if world > 1:
        coll.setup_default(device, timeout)  # collective: the gloo twin beside NCCL
    if device.type == "cuda":
        print(
            f"[distributed] rank {rank} of group {os.environ.get('FTREC_REPLICA_GROUP', '0')} on {device} "
            f"({torch.cuda.get_device_name(device)})",
            flush=True,
        )
    return Topology(
        rank,
        world,
        int(os.environ.get("FTREC_REPLICA_GROUP", "0")),
        int(os.environ.get("FTREC_NUM_REPLICA_GROUPS", "1")),
        device,
    )


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def allreduce_grads(params: list[torch.nn.Parameter]) -> float:
    """SUM the gradients over the group's ranks in one flat buffer; returns seconds blocked.

    SUM, not mean: each rank's loss is already divided by the group's global target count.
    """
    if not active():
        return 0.0
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    t = time.perf_counter()
    coll.all_reduce(flat, kind=coll.DATA)
    waited = time.perf_counter() - t
    i = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        if p.grad is None:
            p.grad = g
        p.grad.copy_(flat[i : i + n].view_as(g))
        i += n
    return waited


def barrier() -> None:
    if active():
        coll.barrier()


def broadcast_params(model: torch.nn.Module, exclude: tuple = ()) -> None:
    """Start every rank from rank 0's parameters (seeded init already agrees; this makes sure).
    `exclude`: parameters that differ per rank by design (a sharded table's shard)."""
    if active():
        skip = {id(p) for p in exclude}
        for p in model.parameters():
            if id(p) not in skip:
                coll.broadcast(p.data, 0, kind=coll.DATA)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
