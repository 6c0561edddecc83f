"""What ended the train task's previous try, said in the next try's log.

Airflow's supervisor sees a task process die by a signal and, for SIGKILL, adds "Likely out of
memory error (OOM)" whatever sent it. The train task keeps OUT/train-task.json: who runs the
try (host, pid, process start, the memory cgroup's OOM-kill count) and, when the try ends in
any way Python sees (finished, failed, stopped by SIGTERM, timed out), how. The next try reads
it: a try that ended without a word was killed by SIGKILL (or lost its machine), and the
cgroup's OOM-kill count, then and now, says whether the kernel's OOM killer acted meanwhile."""

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ftcore.launcher.lease import boot_id, start_time
from ftcore.util.files import atomic_write_json

RECORD = "train-task.json"


def oom_kills() -> int | None:
    """Processes the kernel's OOM killer has killed in this process's cgroup (v2), or None."""
    try:
        rel = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
        events = Path("/sys/fs/cgroup", rel.strip().lstrip("/"), "memory.events").read_text()
        return int(next(line.split()[1] for line in events.splitlines() if line.startswith("oom_kill ")))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def explain(prev: dict[str, Any], oom_now: int | None) -> str | None:
    """What ended the try `prev` records, or None when it ended in a way it recorded itself
    and nothing is left to tell."""
    who = f"the previous try (task process {prev.get('pid')} on {prev.get('host')}, started " + time.strftime(
        "%H:%M:%S", time.localtime(prev.get("started", 0))
    )
    if prev.get("ended"):
        return f"{who}) ended: {prev['ended']}"
    same = prev.get("host") == socket.gethostname() and prev.get("boot_id") == boot_id()
    if same and start_time(int(prev.get("pid") or 0)) == prev.get("start"):
        return f"{who}) is still running: its process lives, though Airflow gave up on it"
    then = prev.get("oom_kills")
    if then is None or oom_now is None:
        memory = "whether memory ran out is unknown here (no cgroup v2 memory.events)"
    elif oom_now > then:
        memory = (
            f"the kernel's OOM killer killed {oom_now - then} process(es) in this cgroup since: likely out of memory"
        )
    else:
        memory = "the kernel's OOM killer did not act in this cgroup since (memory.events oom_kill unchanged)"
        memory += ": not out of memory"
    return (
        f"{who}) ended without running its cleanup: its process was killed by a signal it cannot catch "
        f"(SIGKILL: a kill -9, or the OOM killer's) or its machine was lost; {memory}. Airflow's "
        "'Likely out of memory' on that try (beside the signal's name) is its guess for any SIGKILL"
    )


@contextlib.contextmanager
def recorded(out: str | Path, log=print) -> Iterator[None]:
    """Say what ended the previous try (`log`), then record this one, and how it ends."""
    path = Path(out) / RECORD
    with contextlib.suppress(OSError, ValueError):
        said = explain(json.loads(path.read_text()), oom_kills())
        if said:
            log(said)
    me = {
        "host": socket.gethostname(),
        "boot_id": boot_id(),
        "pid": os.getpid(),
        "start": start_time(os.getpid()),
        "started": time.time(),
        "oom_kills": oom_kills(),
    }
    atomic_write_json(path, me)
    try:
        yield
    except BaseException as e:
        first = str(e).splitlines()[0] if str(e) else ""
        atomic_write_json(path, {**me, "ended": f"{type(e).__name__}: {first}"[:300], "t": time.time()})
        raise
    atomic_write_json(path, {**me, "ended": "finished", "t": time.time()})
