"""The transport: how the bytes of an all-to-all or all-reduce move inside a replica group.

`collective`: torch.distributed (gloo on CPU, nccl on GPU) through ftcore/collectives.py.
`smfree`: no communication kernels: per-rank outboxes in same-host shared memory, filled and
drained by a copy thread (on CUDA by the copy engines, cuda_copy.py). `make_transport` falls
back to `collective`, saying why, when smfree cannot run; every rank takes the same decision.
Both are asynchronous (a `Handle`) and bitwise equal; ops run in issue order.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from ftcore import collectives as coll
from ftcore.collectives import all_gather_json  # noqa: F401  (control JSON; was defined here)
from training.comm import COMM_TIMEOUT_S, shm

if TYPE_CHECKING:
    from training.comm.cuda_copy import CopyEngine

log = logging.getLogger(__name__)

KINDS = ("collective", "smfree")


class TransportError(RuntimeError):
    """A transfer failed or a peer did not answer within COMM_TIMEOUT_S."""


@dataclass
class TransportConfig:
    kind: str = "collective"  # "collective" | "smfree"
    shm_dir: str = "/dev/shm"  # where smfree puts its outboxes (must be same-host tmpfs)
    initial_capacity: int = 1 << 20  # bytes per outbox; grows on demand
    host_id: str | None = None  # None: hostname + boot id (set it to force the fallback)


class Handle(Protocol):
    def wait(self) -> torch.Tensor: ...


class Transport(Protocol):
    name: str
    rank: int
    world_size: int

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> Handle:
        """Rows send[sum(send_splits[:p]):...] go to rank p; returns rows from every rank, in rank order."""

    def all_reduce(self, tensor: torch.Tensor) -> Handle:
        """Sum over the ranks, in place; wait() returns `tensor`."""

    def exchange_sizes(self, sizes: list[int]) -> list[int]:
        """sizes[p] goes to rank p; returns what every rank sent me (split sizes: control values)."""

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- collective


class _WorkHandle:
    def __init__(self, work, result: torch.Tensor):
        self._work, self._result = work, result

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._result


class CollectiveTransport:
    """torch.distributed collectives on `group` (gloo / nccl)."""

    name = "collective"
    fallback_reason: str  # set only on the fallback from smfree (open_transport): why smfree could not run

    def __init__(self, group=None):
        self.group = group
        g = coll.get(group)
        self.rank, self.world_size = g.rank(), g.size()

    def all_to_all(self, send, send_splits, recv_splits):
        out, work = coll.all_to_all_single(send, send_splits, recv_splits, group=self.group, async_op=True)
        return _WorkHandle(work, out)

    def all_reduce(self, tensor):
        return _WorkHandle(coll.all_reduce(tensor, kind=coll.DATA, group=self.group, async_op=True), tensor)

    def exchange_sizes(self, sizes):
        return coll.exchange_sizes(sizes, self.group)

    def close(self):
        pass


# ----------------------------------------------------------------------------- smfree (CPU)

# Control block of one rank, int64 slots. Only the owner writes it.
_READY, _DONE, _GEN, _CAP = 0, 1, 2, 3
_HDR = 8  # then OFF[world], LEN[world]: byte offset and length in the outbox of the rows for p


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


# Segments this process created and has not unlinked yet: removed at exit, so that a rank
# failing with an exception leaves nothing in /dev/shm. A SIGKILLed rank's segments are
# removed by the next start's sweep or the launcher's (training/comm/shm.py).
_OWNED: set[str] = set()


@atexit.register
def _unlink_owned():
    for path in list(_OWNED):
        try:
            os.unlink(path)
        except OSError:
            pass


class _Segment:
    """A file in a tmpfs folder, mapped read-write; a uint8 tensor over its bytes."""

    def __init__(self, path: str, size: int, create: bool):
        self.path = path
        # the creator keeps its fd (and with it the segment's lock) open until close()
        fd = shm.create(path, size) if create else os.open(path, os.O_RDWR)
        try:
            if not create:
                size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        if not create:
            os.close(fd)
        self._fd = fd if create else None
        self.size = size
        self._bytes: torch.Tensor | None = torch.frombuffer(self.mm, dtype=torch.uint8)
        if create:
            _OWNED.add(path)

    @property
    def bytes(self) -> torch.Tensor:
        assert self._bytes is not None, f"segment {self.path} used after close()"
        return self._bytes

    def close(self, unlink: bool = False):
        self._bytes = None  # drop the exported buffer before closing the map
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the OS reclaims the map at exit
        if unlink:
            _OWNED.discard(self.path)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _FutureHandle:
    def __init__(self, fut: Future):
        self._fut = fut

    def wait(self):
        return self._fut.result()


class SmFreeTransport:
    """Same-host shared-memory transport; all copies run on this rank's copy thread."""

    name = "smfree"

    def __init__(self, group, cfg: TransportConfig, prefix: str):
        self.group = group
        g = coll.get(group)
        self.rank, self.world_size = g.rank(), g.size()
        self.cfg = cfg
        self._prefix = prefix
        self._seq = 0
        k = self.world_size
        self._ctrl = _Segment(self._ctrl_path(self.rank), 8 * (_HDR + 2 * k), create=True)
        self._ctrl_np = np.frombuffer(self._ctrl.mm, dtype=np.int64)
        self._ctrl_np[:] = 0
        self._gen = 0
        self._outbox = self._new_outbox(cfg.initial_capacity)
        self._peer_ctrl: dict[int, np.ndarray] = {}
        self._peer_ctrl_seg: dict[int, _Segment] = {}
        self._peer_box: dict[int, tuple[int, _Segment]] = {}
        self._copy_engine: CopyEngine | None = None  # set by cuda_copy when CUDA tensors go through
        self._acc: torch.Tensor | None = None  # all-reduce's host sum (_host_acc)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"smfree-copy-{self.rank}", daemon=True)
        self._thread.start()

    # paths are unique per transport instance: prefix is agreed by all ranks at setup
    def _ctrl_path(self, r):
        return os.path.join(self.cfg.shm_dir, f"ftrec-{self._prefix}-ctrl-{r}")

    def _box_path(self, r, gen):
        return os.path.join(self.cfg.shm_dir, f"ftrec-{self._prefix}-box-{r}-{gen}")

    def _new_outbox(self, capacity: int) -> _Segment:
        seg = _Segment(self._box_path(self.rank, self._gen), capacity, create=True)
        self._ctrl_np[_GEN] = self._gen
        self._ctrl_np[_CAP] = capacity
        return seg

    def connect(self):
        """Map every peer's control block (they exist once setup's all-gather returned)."""
        for p in range(self.world_size):
            if p != self.rank:
                seg = _Segment(self._ctrl_path(p), 0, create=False)
                self._peer_ctrl_seg[p] = seg
                self._peer_ctrl[p] = np.frombuffer(seg.mm, dtype=np.int64)
        self._peer_ctrl[self.rank] = self._ctrl_np

    # -- public API: enqueue on the copy thread, ops run in issue order
    def all_to_all(self, send, send_splits, recv_splits):
        ready = self._ready_event(send)
        return self._submit(lambda: self._all_to_all(send, list(send_splits), list(recv_splits), ready))

    def all_reduce(self, tensor):
        ready = self._ready_event(tensor)
        return self._submit(lambda: self._all_reduce(tensor, ready))

    def exchange_sizes(self, sizes):
        ones = [1] * self.world_size  # through the outboxes too: one order for all of this transport's ops
        return self.all_to_all(torch.tensor(sizes, dtype=torch.int64), ones, ones).wait().tolist()

    def _ready_event(self, t: torch.Tensor):
        # CUDA: the copy stream must wait for the kernels that produce `t`, as issued now.
        return self._copy_engine.record() if (t.is_cuda and self._copy_engine is not None) else None

    def _submit(self, fn: Callable[[], torch.Tensor]) -> _FutureHandle:
        fut: Future = Future()
        self._queue.put((fn, fut))
        return _FutureHandle(fut)

    def _run(self):
        torch.set_num_threads(1)
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as e:  # surfaced to the waiter
                fut.set_exception(e)

    def close(self):
        self._queue.put(None)
        self._thread.join(timeout=COMM_TIMEOUT_S)
        self._peer_ctrl.clear()  # drop the numpy views before their maps close
        self._ctrl_np = None
        for seg in self._peer_ctrl_seg.values():
            seg.close()
        for _, seg in self._peer_box.values():
            seg.close()
        self._outbox.close(unlink=True)
        self._ctrl.close(unlink=True)

    # -- the protocol (copy thread only)
    def _wait_until(self, p: int, slot: int, seq: int, what: str):
        ctrl = self._peer_ctrl[p]
        deadline = time.monotonic() + COMM_TIMEOUT_S
        spins = 0
        while ctrl[slot] < seq:
            spins += 1
            if spins > 200:
                # back off so a waiting copy thread does not take a core from compute
                time.sleep(min(1e-3, 1e-6 * spins))
                if time.monotonic() > deadline:
                    raise TransportError(
                        f"smfree: rank {p} did not {what} op {seq} within {COMM_TIMEOUT_S:.0f}s "
                        f"(peer dead or ops issued in a different order; FTREC_COMM_TIMEOUT_S)"
                    )

    def _peer_outbox(self, p: int) -> torch.Tensor:
        if p == self.rank:
            return self._outbox.bytes
        gen = int(self._peer_ctrl[p][_GEN])
        cached = self._peer_box.get(p)
        if cached is None or cached[0] != gen:
            if cached is not None:
                cached[1].close()
            self._peer_box[p] = (gen, _Segment(self._box_path(p, gen), 0, create=False))
        return self._peer_box[p][1].bytes

    def _publish(self, send_bytes: torch.Tensor, offs: list[int], lens: list[int], ready=None):
        """Write my outgoing bytes for op `seq` once every peer has drained op seq-1."""
        k, seq = self.world_size, self._seq
        for p in range(k):
            self._wait_until(p, _DONE, seq - 1, "finish reading")
        n = send_bytes.numel()
        if n > self._outbox.size:
            old = self._outbox
            self._gen += 1
            self._outbox = self._new_outbox(max(n, 2 * old.size))
            old.close(unlink=True)  # readers keep their own map until they see the new gen
        if n:
            self._copy_in(self._outbox.bytes[:n], send_bytes, ready)
        c = self._ctrl_np
        c[_HDR : _HDR + k] = offs
        c[_HDR + k : _HDR + 2 * k] = lens
        c[_READY] = seq  # last: publishes the bytes and offsets above (x86 stores are ordered)

    def _copy_in(self, dst: torch.Tensor, src: torch.Tensor, ready=None):
        if self._copy_engine is not None and src.is_cuda:
            self._copy_engine.to_host(dst, src, ready)
        else:
            dst.copy_(src)

    def _copy_out(self, dst: torch.Tensor, src: torch.Tensor):
        if self._copy_engine is not None and dst.is_cuda:
            self._copy_engine.to_device(dst, src)
        else:
            dst.copy_(src)

    def _all_to_all(self, send, send_splits, recv_splits, ready=None):
        k = self.world_size
        self._seq += 1
        seq = self._seq
        send = send.contiguous()
        row = int(np.prod(send.shape[1:], dtype=np.int64)) * send.element_size()
        send_bytes = send.reshape(-1).view(torch.uint8)
        offs, lens, o = [], [], 0
        for s in send_splits:
            offs.append(o)
            lens.append(s * row)
            o += s * row
        self._publish(send_bytes, offs, lens, ready)
        out = send.new_empty((sum(recv_splits), *send.shape[1:]))
        out_bytes = out.reshape(-1).view(torch.uint8)
        dst = [0]
        for s in recv_splits:
            dst.append(dst[-1] + s * row)
        for i in range(k):
            p = (self.rank + i) % k  # start with my own rows: no wait
            self._wait_until(p, _READY, seq, "publish")
            ctrl = self._peer_ctrl[p]
            off, ln = int(ctrl[_HDR + self.rank]), int(ctrl[_HDR + k + self.rank])
            if ln != recv_splits[p] * row:
                raise TransportError(
                    f"smfree: rank {p} sent {ln} bytes to rank {self.rank}, "
                    f"expected {recv_splits[p] * row} (split sizes disagree)"
                )
            if ln:
                self._copy_out(out_bytes[dst[p] : dst[p] + ln], self._peer_outbox(p)[off : off + ln])
        self._ctrl_np[_DONE] = seq
        return out

    def _all_reduce(self, tensor, ready=None):
        """Sum on the host, in rank order on every rank (all end bitwise identical): the peers'
        outboxes are host memory already, so the adds run on this copy thread's CPU and the only
        device work is the two copies (copy engines on CUDA): no SM kernel."""
        k = self.world_size
        self._seq += 1
        seq = self._seq
        src = tensor.contiguous()
        n = src.numel() * src.element_size()
        self._publish(src.reshape(-1).view(torch.uint8), [0] * k, [n] * k, ready)
        acc = self._host_acc(n).view(src.dtype).view(src.shape)
        for p in range(k):
            self._wait_until(p, _READY, seq, "publish")
            peer = self._peer_outbox(p)[:n].view(src.dtype).view(src.shape)
            if p == 0:
                acc.copy_(peer)
            else:
                acc += peer
        self._ctrl_np[_DONE] = seq
        if src.is_cuda:
            self._copy_out(src, acc)  # host -> device on the copy stream
            if src.data_ptr() != tensor.data_ptr():
                tensor.copy_(src)  # a non-contiguous input: gather back (a kernel, as the caller's layout asks)
        else:
            tensor.copy_(acc)
        return tensor

    def _host_acc(self, n: int) -> torch.Tensor:
        """The host buffer all-reduce sums into, reused (pinned when CUDA goes through: the
        copy back to the device is then a copy-engine transfer)."""
        if self._acc is None or self._acc.numel() < n:
            pin = self._copy_engine is not None
            self._acc = torch.empty(max(n, 1 << 16), dtype=torch.uint8, pin_memory=pin)
        return self._acc[:n]


# ----------------------------------------------------------------------------- selection


def make_transport(cfg: TransportConfig | str = "collective", group=None, device: str = "cpu") -> Transport:
    """The configured transport for `group`, or `collective` with a logged reason when smfree
    cannot run. Collective over `group` (it exchanges setup facts); every rank must call it.

    Raises ValueError for an unknown kind (a user's config error)."""
    if isinstance(cfg, str):
        cfg = TransportConfig(kind=cfg)
    if cfg.kind not in KINDS:
        raise ValueError(f"comm.transport = {cfg.kind!r} is not one of {KINDS}; fix the config")
    if cfg.kind == "collective":
        return CollectiveTransport(group)

    # Gather every rank's facts, then all decide the same.
    reason = None
    transport = None
    prefix = uuid.uuid4().hex[:12]
    prefix = all_gather_json(prefix, group)[0]  # rank 0's prefix names this instance's files
    if device != "cpu":
        from training.comm import cuda_copy

        reason = cuda_copy.unavailable_reason()
    if reason is None:
        if not os.path.isdir(cfg.shm_dir) or not os.access(cfg.shm_dir, os.W_OK):
            reason = f"shared-memory folder {cfg.shm_dir} is missing or not writable"
        else:
            shm.sweep(cfg.shm_dir)  # segments of ranks killed before they could remove them
            try:
                transport = SmFreeTransport(group, cfg, prefix)
            except OSError as e:
                reason = f"cannot create shared memory in {cfg.shm_dir}: {e}"
    facts = all_gather_json({"host": cfg.host_id or _host_id(), "reason": reason}, group)
    hosts = sorted({f["host"] for f in facts})
    reasons = [f"rank {r}: {f['reason']}" for r, f in enumerate(facts) if f["reason"]]
    if len(hosts) > 1:
        reasons.insert(0, f"ranks are on {len(hosts)} different hosts ({', '.join(hosts)})")
    if reasons:
        if transport is not None:
            transport.close()
        log.warning("comm.transport=smfree cannot run, falling back to collective: %s", "; ".join(reasons))
        fallback = CollectiveTransport(group)
        fallback.fallback_reason = "; ".join(reasons)
        return fallback
    assert transport is not None  # no rank gave a reason, so this one built its transport
    transport.connect()
    if device != "cpu":
        from training.comm import cuda_copy

        transport._copy_engine = cuda_copy.CopyEngine(transport, device)
    coll.barrier(group)  # every peer mapped before anyone's first op can grow an outbox
    return transport
