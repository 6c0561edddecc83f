"""One rule for where a collective's tensors live: DATA (gradients, parameters, rows) on the
group's device, CONTROL values the host reads (counts, flags, votes, timings, JSON, barriers)
as CPU tensors on a gloo twin built beside each device group: a gloo wait can be bounded and
abandoned, an NCCL kernel cannot. `HostStage` stages device tensors through pinned host
buffers on a side stream (the copy engines). Why, in full: docs/ftcore.md, "collectives"."""

from __future__ import annotations

import contextvars
import datetime
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

DATA, CONTROL = "data", "control"
KINDS = (DATA, CONTROL)
CPU = torch.device("cpu")


@dataclass(eq=False)
class ProcessGroupInfo:
    """A process group as this layer sees it: where its data goes, and its control channel."""

    pg: Any  # the data group: a c10d ProcessGroup, or a backend built on a store
    backend: str
    device: torch.device  # where DATA tensors must be for `pg`
    control: Any  # a CPU gloo group: `pg` itself when `pg` is gloo

    def size(self) -> int:
        return self.pg.size()

    def rank(self) -> int:
        return self.pg.rank()


_groups: dict[int, ProcessGroupInfo] = {}  # id(pg) -> its info; the info holds its pg, so the id stays unique
# name -> (factory(store, rank, size, timeout) -> pg, device type) for groups built on a store
_factories: dict[str, tuple[Callable, str]] = {}
_placed: contextvars.ContextVar[tuple] = contextvars.ContextVar("ftcore_placed", default=())


def placed() -> tuple:
    """The tensors the DATA op now being issued put on its group's device (for test backends)."""
    return _placed.get()


def register(pg, backend: str, device: torch.device | str | None = None, control=None) -> ProcessGroupInfo:
    """Make `pg` known: its backend, its data device, its CPU gloo control group."""
    if backend == "gloo":
        info = ProcessGroupInfo(pg, backend, CPU, pg)
    elif control is None or device is None:
        raise ValueError(f"ftcore.collectives: a {backend} group needs its device and a gloo control group")
    else:
        info = ProcessGroupInfo(pg, backend, torch.device(device), control)
    _groups[id(pg)] = info
    return info


def _backend_name(pg) -> str:
    try:
        return str(dist.get_backend(pg))
    except (ValueError, RuntimeError, AttributeError):
        return pg.name()  # a backend built on a store (ftcore's cross-group gloo groups, tests)


def get(group=None) -> ProcessGroupInfo:
    """The info of `group` (a ProcessGroupInfo, a process group, or None: the default group)."""
    if isinstance(group, ProcessGroupInfo):
        return group
    pg = dist.group.WORLD if group is None else group
    if pg is None:
        raise RuntimeError("ftcore.collectives: torch.distributed is not initialized")
    info = _groups.get(id(pg))
    if info is not None:
        return info
    name = _backend_name(pg)
    if name == "gloo":  # CPU: data and control on the group itself
        return register(pg, "gloo")
    raise RuntimeError(
        f"ftcore.collectives: the {name} group has no CPU control channel; build it with "
        "ftcore.collectives.setup_default() (after init_process_group), new_group() or new_pg()"
    )


def _device_for(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def setup_default(
    device: torch.device | str | None = None, timeout: datetime.timedelta | None = None
) -> ProcessGroupInfo:
    """Register the default group; beside a device backend, build its gloo twin (collective:
    every rank calls it once, right after init_process_group). Idempotent."""
    pg = dist.group.WORLD
    if id(pg) in _groups:
        return _groups[id(pg)]
    name = str(dist.get_backend(pg))
    if name == "gloo":
        return register(pg, "gloo")
    control = dist.new_group(backend="gloo", timeout=timeout)
    dev_type = _factories.get(name, (None, "cuda"))[1]
    return register(pg, name, device if device is not None else _device_for(dev_type), control)


def new_group(
    backend: str | None = None, timeout: datetime.timedelta | None = None, device: torch.device | str | None = None
) -> Any:
    """`dist.new_group` over every rank, registered, with a gloo twin beside a device backend
    (collective). `device`: where its data goes (default: the default group's device)."""
    pg = dist.new_group(backend=backend, timeout=timeout)
    name = str(dist.get_backend(pg))
    if name == "gloo":
        register(pg, "gloo")
        return pg
    control = dist.new_group(backend="gloo", timeout=timeout)
    register(pg, name, device if device is not None else get().device, control)
    return pg


def _gloo(store, rank: int, size: int, timeout: datetime.timedelta, host: str):
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, absent from the stubs
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl(store, rank: int, size: int, timeout: datetime.timedelta):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout  # the watchdog aborts a collective blocked longer than this
    return dist.ProcessGroupNCCL(store, rank, size, opts)


_factories["nccl"] = (_nccl, "cuda")


def register_backend(name: str, factory: Callable, device_type: str = "cuda") -> None:
    """A device backend `factory(store, rank, size, timeout) -> ProcessGroup`: torch learns it
    (init_process_group, new_group), and ftcore's cross-group groups may use it (`new_pg`)."""
    dist.Backend.register_backend(name, factory, devices=[device_type])
    _factories[name.lower()] = (factory, device_type)


def backends() -> tuple[str, ...]:
    return ("gloo", *_factories)


def new_pg(
    backend: str,
    store,
    rank: int,
    size: int,
    timeout: datetime.timedelta,
    host: str = "127.0.0.1",
    device: torch.device | None = None,
):
    """A process group on `store` outside c10d's world (ftcore's per-quorum cross-group group),
    gloo listening on `host`; a device backend gets its gloo twin on the same store."""
    if backend == "gloo":
        pg = _gloo(store, rank, size, timeout, host)
        register(pg, "gloo")
        return pg
    if backend not in _factories:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(backends())}")
    factory, device_type = _factories[backend]
    pg = factory(dist.PrefixStore("data", store), rank, size, timeout)
    control = _gloo(dist.PrefixStore("control", store), rank, size, timeout, host)
    register(pg, backend, device if device is not None else _device_for(device_type), control)
    return pg


# ---- the collectives ------------------------------------------------------------------------


class Work:
    """An issued collective. wait(): done, and a staged result copied back to the caller's tensor."""

    def __init__(self, work, after: Callable[[], None] | None = None):
        self._work, self._after = work, after

    def wait(self) -> bool:
        self._work.wait()
        if self._after is not None:
            after, self._after = self._after, None
            after()
        return True

    def get_future(self) -> torch.futures.Future:
        fut = self._work.get_future()
        if self._after is None:
            return fut
        after, self._after = self._after, None
        return fut.then(lambda f: (f.value(), after())[0])


def _channel(info: ProcessGroupInfo, kind: str) -> tuple[Any, torch.device]:
    if kind == DATA:
        return info.pg, info.device
    if kind == CONTROL:
        return info.control, CPU
    raise ValueError(f"ftcore.collectives: kind must be DATA or CONTROL, not {kind!r}")


def _put(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # a CUDA tensor for gloo, or a host tensor for NCCL: a copy (blocking on the current stream)
    return t if t.device == device else t.to(device)


def _issue(kind: str, tensors: list[torch.Tensor], fn: Callable[[], Any]) -> Any:
    token = _placed.set(tuple(tensors)) if kind == DATA else None
    try:
        return fn()
    finally:
        if token is not None:
            _placed.reset(token)


def _done(work, async_op: bool, after=None) -> Work | None:
    w = Work(work, after)
    if async_op:
        return w
    w.wait()
    return None


@overload
def all_reduce(
    t: torch.Tensor, *, kind: str, group: Any = None, op: Any = dist.ReduceOp.SUM, async_op: Literal[True]
) -> Work: ...
@overload
def all_reduce(
    t: torch.Tensor, *, kind: str, group: Any = None, op: Any = dist.ReduceOp.SUM, async_op: Literal[False] = False
) -> None: ...
@overload
def all_reduce(
    t: torch.Tensor, *, kind: str, group: Any = None, op: Any = dist.ReduceOp.SUM, async_op: bool = False
) -> Work | None: ...
def all_reduce(
    t: torch.Tensor, *, kind: str, group: Any = None, op: Any = dist.ReduceOp.SUM, async_op: bool = False
) -> Work | None:
    """In place over the group's ranks (async_op: returns the issued Work)."""
    info = get(group)
    pg, dev = _channel(info, kind)
    buf = _put(t, dev)
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    work = _issue(kind, [buf], lambda: pg.allreduce([buf], opts))
    return _done(work, async_op, (lambda: t.copy_(buf)) if buf is not t else None)


def broadcast(t: torch.Tensor, src: int = 0, *, kind: str, group=None) -> None:
    """In place, from group rank `src`."""
    info = get(group)
    pg, dev = _channel(info, kind)
    buf = _put(t, dev)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0
    _issue(kind, [buf], lambda: pg.broadcast([buf], opts)).wait()
    if buf is not t:
        t.copy_(buf)


def all_gather(t: torch.Tensor, *, kind: str, group=None) -> list[torch.Tensor]:
    """Every rank's `t` (same shape on every rank), in rank order, on `t`'s device."""
    info = get(group)
    pg, dev = _channel(info, kind)
    buf = _put(t.contiguous(), dev)
    outs = [torch.empty_like(buf) for _ in range(info.size())]
    _issue(kind, [buf, *outs], lambda: pg.allgather([outs], [buf], AllgatherOptions())).wait()
    return [o if o.device == t.device else o.to(t.device) for o in outs]


def all_to_all_single(
    send: torch.Tensor, send_splits: list[int], recv_splits: list[int], *, group=None, async_op: bool = False
) -> tuple[torch.Tensor, Work | None]:
    """DATA: rows send[sum(send_splits[:p]):...] go to rank p; returns (rows from every rank in
    rank order, on `send`'s device, complete after wait(); the Work, or None when not async)."""
    info = get(group)
    buf = _put(send.contiguous(), info.device)
    recv = buf.new_empty((sum(recv_splits), *buf.shape[1:]))
    out = recv if recv.device == send.device else send.new_empty(recv.shape)
    work = _issue(
        DATA,
        [recv, buf],
        lambda: info.pg.alltoall_base(recv, buf, list(recv_splits), list(send_splits), dist.AllToAllOptions()),
    )
    return out, _done(work, async_op, (lambda: out.copy_(recv)) if out is not recv else None)


def exchange_sizes(sizes: list[int], group=None) -> list[int]:
    """CONTROL all-to-all of one integer per rank: what each rank sends me (split sizes)."""
    info = get(group)
    send = torch.tensor(sizes, dtype=torch.int64)
    recv = torch.empty_like(send)
    info.control.alltoall_base(recv, send, [1] * info.size(), [1] * info.size(), dist.AllToAllOptions()).wait()
    return recv.tolist()


def barrier(group=None) -> None:
    """CONTROL: every rank of the group got here."""
    get(group).control.barrier(dist.BarrierOptions()).wait()


def all_gather_json(obj, group=None) -> list:
    """CONTROL: every rank's JSON-able object, as bytes (no pickle crosses the wire)."""
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = all_gather(torch.tensor([data.numel()], dtype=torch.int64), kind=CONTROL, group=group)
    m = int(max(s.item() for s in sizes))
    padded = torch.zeros(m, dtype=torch.uint8)
    padded[: data.numel()] = data
    bufs = all_gather(padded, kind=CONTROL, group=group)
    return [json.loads(bytes(b[: int(s.item())].tolist()).decode()) for b, s in zip(bufs, sizes, strict=True)]


# ---- host staging on the copy engines -------------------------------------------------------


class HostStage:
    """Device tensors to reusable pinned host buffers and back, on one side stream (cudaMemcpyAsync:
    the copy engines, no SM kernels). Ordered by events: the copy down waits for the kernels
    that produced the tensor, the compute stream waits for the copy up; nothing synchronizes
    the device. On a CPU `device` the same calls are plain copies (for tests)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._bufs: dict[int, torch.Tensor] = {}

    def _buffer(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        b = self._bufs.get(slot)
        if b is None or b.dtype != like.dtype or b.numel() < like.numel():
            b = torch.empty(like.numel(), dtype=like.dtype, pin_memory=self.cuda)
            self._bufs[slot] = b
        return b[: like.numel()].view(like.shape)

    def to_host(self, slot: int, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying `src` into host buffer `slot`; returns (buffer, event: query() True once it landed)."""
        host = self._buffer(slot, src)
        stream = self.stream
        if stream is None:
            host.copy_(src)
            return host, _Ready()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            host.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        src.record_stream(stream)  # the caller may free `src` before the copy ran
        return host, done

    def to_device(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        """Copy `host` into `dst`; kernels issued afterwards on the current stream see the result."""
        stream = self.stream
        if stream is None:
            dst.copy_(host)
            return
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream(self.device))  # dst's producers first
            dst.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        dst.record_stream(stream)
        torch.cuda.current_stream(self.device).wait_event(done)

    def drop(self) -> None:
        """Forget the buffers (a failed collective still references them; new ones next time)."""
        self._bufs = {}


class _Ready:
    def query(self) -> bool:
        return True


_stages: dict[torch.device, HostStage] = {}


def stage_for(group, tensors: list[torch.Tensor]) -> HostStage | None:
    """The HostStage that DATA `tensors` need to reach `group`'s device, or None (already there)."""
    info = get(group)
    devs = {t.device for t in tensors}
    if not devs or devs == {info.device}:
        return None
    if len(devs) > 1:
        raise ValueError(f"ftcore.collectives: tensors on several devices {sorted(map(str, devs))}")
    dev = devs.pop()
    if dev.type != "cuda" or info.device != CPU:
        return None  # another mix (host tensors for a device group): the plain staging copy
    if dev not in _stages:
        _stages[dev] = HostStage(dev)
    return _stages[dev]


def wait_event(ev, deadline: float, is_stale: Callable[[], bool], what: str, error: type[Exception]) -> None:
    """Poll a copy's event until it lands, within `deadline` (monotonic) and while not `is_stale()`."""
    while not ev.query():
        if time.monotonic() > deadline:
            raise error(f"{what}: timed out")
        if is_stale():
            raise error(f"{what}: a member of the quorum was declared failed")
        time.sleep(0.0001)
