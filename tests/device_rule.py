"""A stand-in for NCCL on a machine without a GPU: the test "device backend".

NCCL takes only tensors on its GPU, and ftcore/collectives.py's data path is what puts a
tensor there; a CPU machine cannot tell devices apart, so this backend takes only the
tensors the layer placed for the DATA op being issued (`collectives.placed()`), refuses
everything else (a control value, a barrier, any collective issued around the layer) the way
NCCL refuses a CPU tensor, and records every call. The work itself is done by a real gloo
group inside it.

`setup(rank)` registers it (torch: init_process_group / new_group; ftcore: cross-group
groups); run_ranks(..., backend=NAME, setup=setup) starts ranks whose default group is one.
"""

import torch
import torch.distributed as dist

from ftcore import collectives as coll

NAME = "ftrec_test_device"
CALLS: list[dict] = []  # every call this process's device groups saw
REJECTED: list[str] = []  # the refused ones, with what was wrong


def _describe(t) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


class DataOnlyPG(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:
        return NAME

    def _check(self, op: str, tensors: list[torch.Tensor]) -> None:
        placed = coll.placed()
        bad = [t for t in tensors if not any(t is p for p in placed)]
        CALLS.append({"op": op, "tensors": [_describe(t) for t in tensors], "ok": not bad})
        if bad:
            msg = (
                f"{NAME}: {op} of {', '.join(map(_describe, bad))} that ftcore.collectives did not place as "
                "data: a control value on the device group (NCCL would refuse a CPU tensor)"
            )
            REJECTED.append(msg)
            raise RuntimeError(msg)

    def allreduce(self, tensors, opts):
        self._check("allreduce", tensors)
        return self._gloo.allreduce(tensors, opts)

    def allgather(self, outputs, inputs, opts):
        self._check("allgather", [*inputs, *(t for out in outputs for t in out)])
        return self._gloo.allgather(outputs, inputs, opts)

    def broadcast(self, tensors, opts):
        self._check("broadcast", tensors)
        return self._gloo.broadcast(tensors, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        self._check("alltoall_base", [output, input])
        return self._gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts):
        msg = f"{NAME}: barrier on the device group (a control op: it belongs on the gloo twin)"
        CALLS.append({"op": "barrier", "tensors": [], "ok": False})
        REJECTED.append(msg)
        raise RuntimeError(msg)


def _create(store, rank, size, timeout):
    return DataOnlyPG(store, rank, size, timeout)


def setup(rank: int = 0) -> None:
    if NAME not in coll.backends():
        coll.register_backend(NAME, _create, device_type="cpu")
