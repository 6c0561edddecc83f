"""FTAR: the fault-tolerant all-reduce across replica groups. Buckets go out at once; the first
carries the meta (contributes, step, member count, error flag), so a healthy step costs one
collective per bucket and the sum says who contributed and whether anyone failed. Every wait
is bounded by a deadline and by `is_stale()`: a dead or hung peer is an FTARError, never a
hang, and a wait that makes no progress asks the lighthouse early (`on_stall`). CUDA
gradients are staged through host memory over gloo: docs/ftcore.md, "ftar"."""

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ftcore import collectives as coll
from ftcore.collectives import DATA

DEFAULT_BUCKET_BYTES = 8 << 20
META = 4  # [contributes, step mod STEP_MOD, 1, error] in front of the first bucket
STEP_MOD = 4096  # members * STEP_MOD stays exact in float32 (< 2**24) up to 4,096 groups


class FTARError(RuntimeError):
    """The all-reduce did not complete (peer failure, timeout, membership change)."""


# Collectives abandoned after a failure stay referenced here until they finish: dropping
# a pending gloo future blocks the dropping thread until the op completes, which for a
# hung peer is as long as the hang. A reaper forgets them once done.
_abandoned: list[tuple[list[torch.futures.Future], object]] = []
_abandoned_lock = threading.Lock()


def _abandon(futs: list[torch.futures.Future], keep: object) -> None:
    with _abandoned_lock:
        _abandoned.append((futs, keep))
        if len(_abandoned) == 1:
            threading.Thread(target=_reap, daemon=True, name="ftar-reaper").start()


def _reap() -> None:
    while True:
        time.sleep(0.5)
        with _abandoned_lock:
            _abandoned[:] = [(f, k) for f, k in _abandoned if not all(x.done() for x in f)]
            if not _abandoned:
                return


@dataclass
class FTARResult:
    contributors: int  # groups whose gradients are in the average
    peer_error: bool  # some group flagged a local failure: discard the step


class _Bucket:
    def __init__(self, tensors: list[torch.Tensor], chunk: torch.Tensor | None = None):
        self.tensors = tensors
        self.chunk = chunk  # in-place view of one large tensor
        self.flat: torch.Tensor | None = None
        self.meta: torch.Tensor | None = None  # the call's control elements, in front of the data

    def buffer(self) -> torch.Tensor:
        if self.chunk is not None:
            return self.chunk
        parts = [t.reshape(-1) for t in self.tensors]
        if self.meta is not None:
            dev, dtype = (parts[0].device, parts[0].dtype) if parts else (self.meta.device, self.meta.dtype)
            parts.insert(0, self.meta.to(device=dev, dtype=dtype))
        self.flat = torch.cat(parts)
        return self.flat

    def buffer_view(self) -> torch.Tensor:
        """The buffer buffer() returned (finish() reads the reduced sum from it)."""
        view = self.chunk if self.chunk is not None else self.flat
        if view is None:
            raise RuntimeError("FTAR: a bucket was read before buffer() built it")
        return view

    def finish(self, n: float) -> None:
        if self.chunk is not None:
            self.chunk.div_(n)
            return
        flat = self.buffer_view()
        i = META if self.meta is not None else 0
        for t in self.tensors:
            k = t.numel()
            if t.is_contiguous():
                torch.div(flat[i : i + k].view_as(t), n, out=t)
            else:
                t.copy_(flat[i : i + k].view_as(t) / n)
            i += k


def plan(tensors: list[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[_Bucket]:
    """Buckets in tensor order: chunks of large tensors in place, small ones packed by dtype."""
    buckets: list[_Bucket] = []
    small: dict[torch.dtype, list[torch.Tensor]] = {}
    size: dict[torch.dtype, int] = {}
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if t.is_contiguous() and nbytes >= bucket_bytes // 2:
            flat = t.view(-1)
            step = max(bucket_bytes // t.element_size(), 1)
            buckets += [_Bucket([t], flat[i : i + step]) for i in range(0, flat.numel(), step)]
            continue
        small.setdefault(t.dtype, []).append(t)
        size[t.dtype] = size.get(t.dtype, 0) + nbytes
        if size[t.dtype] >= bucket_bytes:
            buckets.append(_Bucket(small.pop(t.dtype)))
            size[t.dtype] = 0
    buckets += [_Bucket(ts) for ts in small.values() if ts]
    return buckets


@dataclass
class _Waits:
    """How every wait of one FTAR is bounded: by its deadline and by `is_stale()`. A wait with
    no progress for `stall_s` calls `on_stall` once: the lighthouse is asked at once whether a
    member went silent (a partition closes no connection), not after the whole timeout."""

    deadline: float
    is_stale: Callable[[], bool]
    stall_s: float = math.inf
    on_stall: Callable[[], None] | None = None

    def future(self, fut: torch.futures.Future, what: str) -> None:
        # Poll rather than block: a done-callback must win the GIL from the waiting thread,
        # which measured here costs milliseconds per collective; polling costs microseconds.
        start = time.monotonic()
        while not fut.done():
            now = time.monotonic()
            if now > self.deadline:
                raise FTARError(f"{what}: timed out")
            if self.is_stale():
                raise FTARError(f"{what}: a member of the quorum was declared failed")
            if self.on_stall is not None and now - start > self.stall_s:
                self.on_stall()
                self.on_stall = None
            time.sleep(0.0001 if now - start < 0.005 else 0.0005)
        try:
            fut.value()
        except Exception as e:  # gloo: "Connection reset by peer", "Connection closed by peer", timeouts
            raise FTARError(f"{what}: {type(e).__name__}: {e}") from None


def ftar(
    pg,
    tensors: list[torch.Tensor],
    *,
    contribute: bool,
    local_error: bool = False,
    timeout: float = 5.0,
    is_stale: Callable[[], bool] = lambda: False,
    stall_s: float = math.inf,
    on_stall: Callable[[], None] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    during: Callable[[], None] | None = None,
    step: int = 0,
    stage: coll.HostStage | None = None,
) -> FTARResult:
    """Average `tensors` in place over the replica groups of `pg` (None: this group alone).

    Raises FTARError when the collective cannot complete, or when its members were not all
    at `step` (a collective left pending by a member that gave up on it is never averaged
    into another step). `during` runs as the exchange starts (fault injection; an exception
    sets the error flag). `stage`: how buckets reach the device (collectives.stage_for).
    `on_stall`: called once when a wait makes no progress for `stall_s` (_Waits)."""
    if not contribute:
        for t in tensors:
            t.zero_()
    if pg is None and local_error:
        return FTARResult(int(contribute), True)
    if during:  # at the start of the exchange: an injected failure still reaches the meta
        try:
            during()
        except Exception:
            local_error = True
    if pg is None:
        return FTARResult(int(contribute), local_error)
    info = coll.get(pg)
    meta = torch.tensor(
        [1.0 if contribute else 0.0, float(step % STEP_MOD), 1.0, 1.0 if local_error else 0.0], dtype=torch.float64
    )
    buckets = _with_meta(plan(tensors, bucket_bytes), meta)
    stage = stage if stage is not None else coll.stage_for(info, tensors)
    # staged: every copy down is queued at once; bucket i goes out as soon as its copy landed
    hosts = [
        stage.to_host(i, b.buffer()) if stage is not None and b.tensors else (b.buffer(), None)
        for i, b in enumerate(buckets)
    ]
    futs: list[torch.futures.Future] = []
    try:
        waits = _Waits(time.monotonic() + timeout, is_stale, stall_s, on_stall)
        n, errors = _exchange(info, buckets, hosts, futs, stage, step, waits)
    except FTARError:
        _abandon(futs, (meta, buckets, hosts))
        if stage is not None:
            stage.drop()  # pending collectives may still write into these buffers
        raise
    return FTARResult(int(round(n)), errors > 0)


def _with_meta(buckets: list[_Bucket], meta: torch.Tensor) -> list[_Bucket]:
    """The buckets with the meta riding first: on the first whole float bucket, or alone (CPU
    float64, never staged). Its sum is needed before any bucket is divided."""
    carrier = next(
        (b for b in buckets if b.chunk is None and b.tensors[0].dtype in (torch.float32, torch.float64)), None
    )
    if carrier is None:
        carrier = _Bucket([])
    else:
        buckets.remove(carrier)
    carrier.meta = meta
    return [carrier, *buckets]


def _exchange(info, buckets, hosts, futs, stage, step, waits: _Waits) -> tuple[float, float]:
    """Issue every bucket's all-reduce, check the meta, finish each bucket as its sum lands:
    (contributors, error flags)."""
    for i, (buf, landed) in enumerate(hosts):
        if landed is not None:
            coll.wait_event(landed, waits.deadline, waits.is_stale, f"FTAR bucket {i} copy to host", FTARError)
        futs.append(coll.all_reduce(buf, kind=DATA, group=info, async_op=True).get_future())
    waits.future(futs[0], "FTAR bucket 0")
    n, steps, members, errors = (float(x) for x in hosts[0][0][:META].tolist())
    if members != info.size() or steps != members * (step % STEP_MOD):
        raise FTARError(
            f"FTAR: the members were not all at step {step} (a collective left over from an earlier step or quorum)"
        )
    for i, (b, fut) in enumerate(zip(buckets, futs, strict=True)):
        if i:
            waits.future(fut, f"FTAR bucket {i}")
        if n > 0 and b.tensors:
            if stage is not None and hosts[i][1] is not None:  # staged: the sum back to the device, divided there
                stage.to_device(b.buffer_view(), hosts[i][0])
            b.finish(n)
    return n, errors
