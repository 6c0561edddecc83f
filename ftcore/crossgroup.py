"""The cross-group process group of this rank's current quorum: rank k of every group in its
exchange (Quorum.exchange), built on the rendezvous store that rank k of the exchange's first
group hosts, under a fresh prefix per quorum (the default process group cannot shrink or grow)."""

import datetime
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from ftcore import collectives as coll
from ftcore import netaddr, timeouts
from ftcore.messages import Quorum


class RendezvousAborted(RuntimeError):
    """A member of the quorum failed (or a newer quorum formed) before everyone met."""


class CrossGroup:
    """The store this rank hosts (for the quorums its group leads) and
    the process group built for one Quorum.key."""

    def __init__(self, host: str, backend: str):
        self.host, self.backend = host, backend
        # on a socket bound to `host` alone (TCPStore's own listens everywhere)
        fd, port = netaddr.listen_fd(host)
        self.store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, master_listen_fd=fd, timeout=_timeout()
        )
        self.pg: dist.ProcessGroup | None = None
        self.key: tuple[str, int, bool] | None = None  # the Quorum.key `pg` was built for

    def build(
        self,
        q: Quorum,
        group: int,
        rank: int,
        abort: Callable[[], bool] = lambda: False,
        on_stall: Callable[[], None] | None = None,
    ) -> None:
        """The process group of quorum `q`'s exchange for this rank (rank k of group `group`):
        none when the exchange is this group alone or the group is aside (Quorum.aside).
        RendezvousAborted as soon as `abort()` says a member failed; `on_stall()` once when the
        members have not all met after STALL_PROBE (`_rendezvous`)."""
        self.drop()
        members = q.exchange()
        if len(members) > 1 and group in members:
            # rank k of the first group hosts rank k's rendezvous; a client of its own for each one
            # (a store client serves one call at a time: an abandoned rendezvous still waits in its own)
            host, _, port = q.store.rpartition(":")
            store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=_timeout())
            settled = "/settled" if q.settled else ""
            prefix = dist.PrefixStore(f"ftcore/{q.lighthouse_id}/{q.quorum_id}{settled}/{rank}", store)
            args = (self.backend, prefix, members.index(group), len(members), _timeout(), self.host)
            self.pg = _rendezvous(args, abort, on_stall)
        self.key = q.key

    def drop(self) -> None:
        """Forget the current group (a peer failed it, or a new quorum replaces it)."""
        pg, self.pg, self.key = self.pg, None, None
        if pg is not None:
            _retire(pg)


def _rendezvous(args: tuple, abort: Callable[[], bool], on_stall: Callable[[], None] | None) -> dist.ProcessGroup:
    """new_pg(*args), given up as soon as `abort()`: a member that died just after the quorum
    formed would otherwise hold the others in the group's rendezvous for COLLECTIVE_TIMEOUT,
    while the lighthouse already says it failed. A member that hangs there closes no
    connection and the lighthouse may not judge its silence (most groups hung at once look
    like its own isolation): after STALL_PROBE `on_stall()` asks it to probe them, as a
    stalled FTAR does. An abandoned rendezvous ends on its own (built or timed out, bounded)
    in its thread, and a group it builds is retired unused."""
    stall_at = time.monotonic() + timeouts.STALL_PROBE
    done = threading.Event()
    out: list = []

    def build() -> None:
        try:
            out.append(new_pg(*args))
        except Exception as e:  # the store's timeout, a reset: raised below, or dropped once abandoned
            out.append(e)
        done.set()

    threading.Thread(target=build, daemon=True, name="ftcore-rendezvous").start()
    while not done.wait(0.005):
        if on_stall is not None and time.monotonic() > stall_at:
            on_stall()
            on_stall = None
        if abort():
            threading.Thread(target=_retire_when_built, args=(done, out), daemon=True).start()
            raise RendezvousAborted(
                "a member of the quorum failed, or gave its exchange up, before its group was built"
            )
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0]


def _retire_when_built(done: threading.Event, out: list) -> None:
    done.wait(timeouts.COLLECTIVE_TIMEOUT * 2)
    if out and not isinstance(out[0], Exception):
        _retire(out[0])


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=timeouts.COLLECTIVE_TIMEOUT)


def new_pg(
    backend: str, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, host: str = "127.0.0.1"
) -> dist.ProcessGroup:
    """One quorum's cross-group process group, its gloo listening on `host` only (with a gloo
    twin for control values beside any other backend, ftcore/collectives.py).

    "nccl" is fenced (ManagerConfig.backend): written for CUDA tensors, never run on a GPU here.
    Its hang handling is NCCL's: the group's timeout arms the watchdog, which with
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 aborts a blocked collective by ending the process, so a
    peer's SIGSTOP restarts the survivors too; FTAR's deadline cannot cancel an NCCL kernel."""
    try:
        return coll.new_pg(backend, store, rank, size, timeout, host)
    except ValueError as e:
        raise ValueError(f"ftcore: {e} (FTCORE_BACKEND)") from None


_retired: list[dist.ProcessGroup] = []


def _retire(pg: dist.ProcessGroup) -> None:
    """Keep an old cross-group process group referenced for the life of the process.

    Measured here: aborting or destroying a gloo group with a collective still pending
    (a hung peer) blocks the calling thread, GIL held, until that collective times out,
    which stalls this rank's training. One leaked group per quorum change is cheap.
    """
    _retired.append(pg)
