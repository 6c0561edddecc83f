"""Shared-memory segments that die with their creator: files in a tmpfs folder, each held
under a shared flock by the process that created it.

A SIGKILLed process runs no cleanup, but the kernel drops its locks: a segment whose lock
can be taken exclusively has no living creator and is removed by `sweep` (a transport's
start, the launcher after it kills a group). No pid files, no pid reuse to fool it.
Standard library only: the launcher uses it without importing torch.
"""

import fcntl
import os
import uuid

PREFIXES = ("ftrec-", ".tmp-ftrec-")  # segments, and segments a killed creator never named


def create(path: str, size: int) -> int:
    """A new segment file of `size` bytes, locked for as long as the returned fd is open.
    It is locked before it gets its name, so a concurrent sweep never sees it unlocked."""
    folder = os.path.dirname(path) or "."
    tmp = os.path.join(folder, f".tmp-ftrec-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.ftruncate(fd, size)
        if os.path.exists(path):
            raise FileExistsError(f"shared-memory segment {path} exists already")
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return fd


def sweep(folder: str) -> list[str]:
    """Remove every ftrec segment in `folder` whose creator is gone; returns their names."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(folder) if n.startswith(PREFIXES)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone already, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its creator is alive
        finally:
            os.close(fd)
        try:
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
    return removed
