"""The replica group's processes: torch.distributed set-up and the gradient all-reduce.

One process: no process group, nothing to reduce. Under torchrun (WORLD_SIZE > 1) the
ranks of ONE replica group form the default process group: gloo on CPU, nccl on CUDA.
Across replica groups, gradients are averaged by the fault-tolerance seam
(training/ft.py), not here. Which replica group this process belongs to comes from
the launcher's environment: FTREC_REPLICA_GROUP (g) and FTREC_NUM_REPLICA_GROUPS (R).
"""

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ftcore import netaddr

COLLECTIVE_TIMEOUT_S = float(os.environ.get("FTREC_COLLECTIVE_TIMEOUT_S", "300"))


@dataclass
class Topology:
    rank: int                 # k: rank within the replica group
    group_size: int           # K
    replica_group: int        # g
    num_replica_groups: int   # R
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def as_params(self) -> dict:
        return {"topology.ranks_per_group": self.group_size, "topology.replica_groups": self.num_replica_groups,
                "topology.backend": dist.get_backend() if dist.is_initialized() else "none",
                "topology.device": str(self.device)}


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


def init() -> Topology:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        store = _listen_where_ftcore_does()
        kw = {"store": store, "rank": rank, "world_size": world} if store is not None else {}
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                                **kw)
    return Topology(rank, world, int(os.environ.get("FTREC_REPLICA_GROUP", "0")),
                    int(os.environ.get("FTREC_NUM_REPLICA_GROUPS", "1")), device)


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
    dist.all_reduce(flat)
    waited = time.perf_counter() - t
    i = 0
    for p, g in zip(params, grads):
        n = g.numel()
        if p.grad is None:
            p.grad = g
        p.grad.copy_(flat[i:i + n].view_as(g))
        i += n
    return waited


def comm_device() -> torch.device:
    """Where small collective buffers must live: nccl reduces CUDA tensors only."""
    if active() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if active():
        dist.barrier()


def broadcast_params(model: torch.nn.Module, exclude: tuple = ()) -> None:
    """Start every rank from rank 0's parameters (seeded init already agrees; this makes sure).
    `exclude`: parameters that differ per rank by design (a sharded table's shard)."""
    if active():
        skip = {id(p) for p in exclude}
        for p in model.parameters():
            if id(p) not in skip:
                dist.broadcast(p.data, src=0)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
