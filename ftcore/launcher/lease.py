"""One job per run folder: the launcher's lease on the replica groups it runs in its output folder.

OUT/lease/group-<g>.lock is flock'ed for the launcher's whole life (the kernel lets go when the
process dies, however it dies); OUT/lease/group-<g>.json names the holder (host, boot, pid and
its start time, session, job id) and carries its heartbeat, replaced by atomic rename every
RUN_LEASE_HEARTBEAT seconds. A launcher whose lock is taken is refused. A holder whose lock is
free is taken over only when it is provably dead (`judge`): on this host its pid is gone, belongs
to another process (another start time) or the host rebooted since; on another host (a shared
file system, whose locks may not span hosts) its heartbeat is older than RUN_LEASE_STALE. A
holder that finds its record taken over stops (`RunLease.beat`). Leases are per group, not per
folder: launchers of one job on several hosts (--groups) share a folder, never a group."""

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass

from ftcore import timeouts
from ftcore.launcher.config import LaunchError
from ftcore.util.files import atomic_write_json

LEASE_DIR = "lease"


@dataclass(frozen=True)
class Holder:
    """Who holds a group's lease: the record's one schema (`to_wire` / `parse`)."""

    host: str
    boot_id: str
    pid: int
    start: int  # the pid's start time (clock ticks after boot, /proc/<pid>/stat): a reused pid differs
    session: int  # the launcher's session id: its process tree as the task that started it sees it
    job_id: str
    groups: tuple[int, ...]
    acquired: float
    heartbeat: float

    def to_wire(self) -> dict:
        return {**asdict(self), "groups": list(self.groups)}

    @classmethod
    def parse(cls, d: object) -> "Holder":
        """The record, or ValueError naming the field at fault."""
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        kinds = {"host": str, "boot_id": str, "job_id": str, "pid": int, "start": int, "session": int}
        for name, kind in kinds.items():
            if not isinstance(d.get(name), kind):
                raise ValueError(f"field {name!r}: expected {kind.__name__}")
        for name in ("acquired", "heartbeat"):
            if not isinstance(d.get(name), (int, float)):
                raise ValueError(f"field {name!r}: expected a time")
        groups = d.get("groups")
        if not isinstance(groups, list) or not all(isinstance(g, int) for g in groups):
            raise ValueError("field 'groups': expected a list of group ids")
        return cls(**{**{k: d[k] for k in (*kinds, "acquired", "heartbeat")}, "groups": tuple(groups)})

    def describe(self, now: float) -> str:
        return (
            f"launcher pid {self.pid} on host {self.host} (job {self.job_id}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.acquired))}, "
            f"heartbeat {max(0.0, now - self.heartbeat):.0f}s ago)"
        )


@dataclass(frozen=True)
class Local:
    """What this host knows about a holder: its own identity, and the holder's pid here."""

    host: str
    boot_id: str
    pid_start: int | None  # the start time of the process that has the holder's pid here (None: none)


@dataclass(frozen=True)
class Take:
    reason: str


@dataclass(frozen=True)
class Keep:
    """The holder keeps the lease; `reason` says why (it is not provably dead)."""

    reason: str


def judge(holder: Holder | None, here: Local, now: float, stale_after: float) -> Take | Keep:
    """May a launcher that got a group's lock take the lease from its recorded holder? Only
    from a holder that is provably dead; a live one keeps it."""
    if holder is None:
        return Take("no holder recorded")
    if holder.host == here.host and holder.boot_id == here.boot_id:
        if here.pid_start is None:
            return Take(f"its pid {holder.pid} is gone")
        if here.pid_start != holder.start:
            return Take(
                f"its pid {holder.pid} is another process now (started at {here.pid_start}, not {holder.start})"
            )
        return Keep(f"its pid {holder.pid} is alive on this host")
    if holder.host == here.host:
        return Take("this host rebooted since")
    age = now - holder.heartbeat
    if age > stale_after:
        return Take(f"its heartbeat is {age:.0f}s old, beyond FTCORE_RUN_LEASE_STALE ({stale_after:.0f}s)")
    return Keep(f"its heartbeat is {age:.0f}s old, within FTCORE_RUN_LEASE_STALE ({stale_after:.0f}s)")


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot), or None when there is none
    (or only its zombie: it has exited and let go of its files)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])  # stat(5): state is field 3, start 22
    except FileNotFoundError:
        return None
    except (OSError, IndexError, ValueError):  # no /proc: whether it lives, at least
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0


class LeaseHeld(LaunchError):
    """Another launcher holds a group of this run folder: one line, what to do."""


class RunLease:
    """The leases of `groups` in run folder `out` for one launcher (this process)."""

    def __init__(self, out: str, groups: list[int], job_id: str):
        self.folder = os.path.join(out, LEASE_DIR)
        self.groups = sorted(groups)
        self.job_id = job_id
        self.fds: dict[int, int] = {}
        self.me: Holder | None = None
        self.taken_over: list[str] = []  # for the launch's log: whose stale leases were taken

    def _path(self, g: int, ext: str) -> str:
        return os.path.join(self.folder, f"group-{g}.{ext}")

    def read(self, g: int) -> Holder | None:
        """Group g's recorded holder; None when there is none or the record is unreadable."""
        try:
            with open(self._path(g, "json")) as f:
                return Holder.parse(json.load(f))
        except (OSError, ValueError):
            return None

    def acquire(self) -> Holder:
        """Every group's lease, or LeaseHeld with none of them held."""
        os.makedirs(self.folder, exist_ok=True)
        now = time.time()
        me = Holder(
            host=socket.gethostname(),
            boot_id=boot_id(),
            pid=os.getpid(),
            start=start_time(os.getpid()) or 0,
            session=os.getsid(0),
            job_id=self.job_id,
            groups=tuple(self.groups),
            acquired=now,
            heartbeat=now,
        )
        try:
            for g in self.groups:
                self._take(g, me)
            for g in self.groups:
                atomic_write_json(self._path(g, "json"), me.to_wire())
            lost = [g for g in self.groups if self.read(g) != me]  # a racer on another host wrote last
            if lost:
                raise LeaseHeld(self._refusal(lost[0], "it took the lease at the same moment"))
        except BaseException:
            self.release(remove=False)
            raise
        self.me = me
        return me

    def _take(self, g: int, me: Holder) -> None:
        fd = os.open(self._path(g, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LeaseHeld(self._refusal(g, "it holds the lock")) from None
        self.fds[g] = fd
        holder = self.read(g)
        if holder is not None and (holder.host, holder.pid, holder.start) == (me.host, me.pid, me.start):
            return  # this process's own earlier launch
        here = Local(me.host, me.boot_id, start_time(holder.pid) if holder else None)
        verdict = judge(holder, here, time.time(), timeouts.RUN_LEASE_STALE)
        if isinstance(verdict, Keep):
            raise LeaseHeld(self._refusal(g, verdict.reason))
        if holder is not None:
            self.taken_over.append(f"group {g} from {holder.describe(time.time())}: {verdict.reason}")

    def _refusal(self, g: int, why: str) -> str:
        holder = self.read(g)
        who = holder.describe(time.time()) if holder else "another launcher"
        stop = f" (kill {holder.pid} on {holder.host})" if holder else ""
        return (
            f"{self._path(g, 'lock')}: replica group {g} of this run folder is held by {who}: {why}. One job per "
            f"run folder: wait for that job to end, stop it{stop}, or give another --out"
        )

    def beat(self) -> str | None:
        """Renew the heartbeat; the reason when a group's record is no longer ours (another
        launcher took it over: this one was presumed dead), else None."""
        if self.me is None:
            return "the lease is not held"
        for g in self.groups:
            holder = self.read(g)
            if holder != self.me:
                who = holder.describe(time.time()) if holder else "nobody"
                return f"replica group {g}'s lease ({self._path(g, 'json')}) is now held by {who}"
        self.me = dataclasses.replace(self.me, heartbeat=time.time())
        for g in self.groups:
            atomic_write_json(self._path(g, "json"), self.me.to_wire())
        return None

    def release(self, remove: bool = True) -> None:
        """Let go of every lock held; with `remove`, of our records too (nothing left to judge)."""
        for g, fd in sorted(self.fds.items()):
            if remove and self.me is not None and self.read(g) == self.me:
                with contextlib.suppress(OSError):
                    os.unlink(self._path(g, "json"))
            os.close(fd)  # closing the only descriptor drops the flock
        self.fds.clear()
        self.me = None
