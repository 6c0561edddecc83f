"""The CUDA half of the `smfree` transport: copy-engine transfers, no communication kernels.

UNVERIFIED: never run in this repository's CI (no GPU); benchmarks/gpu_check.py checks it.
The shared-memory outboxes are pinned with cudaHostRegister, so a copy between a CUDA tensor
and an outbox is a cudaMemcpyAsync on a dedicated stream (the DMA copy engines): no kernel
occupies the SMs. Two hops through the host; a peer-to-peer variant is not written.
"""

from __future__ import annotations

import torch


def unavailable_reason() -> str | None:
    """Why the CUDA copy-engine path cannot run in this process, or None."""
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    return None


class CopyEngine:
    """cudaMemcpyAsync on one dedicated stream between CUDA tensors and pinned outboxes."""

    def __init__(self, transport: object, device: torch.device | str | int) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self._pinned: set[int] = set()

    def record(self) -> torch.cuda.Event:
        """An event on the caller's current stream: the copy waits for the producer's kernels."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _pin(self, host: torch.Tensor):
        # Register the whole mapping once; later slices of it are then pinned too.
        base = host.untyped_storage().data_ptr()
        if base not in self._pinned and not host.is_pinned():  # pinned by torch: nothing to register
            size = host.untyped_storage().nbytes()
            rc = torch.cuda.cudart().cudaHostRegister(base, size, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister failed ({rc}) for {size} bytes of shared memory")
            self._pinned.add(base)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, ready: torch.cuda.Event | None):
        self._pin(dst)
        with torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            dst.copy_(src.reshape(-1).view(torch.uint8) if src.dtype != torch.uint8 else src, non_blocking=True)
        self.stream.synchronize()  # the peers may read the outbox as soon as we publish

    def to_device(self, dst: torch.Tensor, src: torch.Tensor):
        self._pin(src)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        self.stream.synchronize()  # the waiter's compute stream may use `dst` after wait()
