"""A CPU hog beside a benchmark: busy-looping child processes, each bounded in time and ended
by its PID, so that a benchmark can report its figures quiet and loaded on the same machine."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

LOADS = ("quiet", "hog")  # a benchmark's --load choices: alone, and beside hog(procs=1)
HOG_LIMIT_S = 900.0  # a hog ends itself after this, whatever happens to its parent

_SPIN = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def hog(procs: int = 1, limit_s: float = HOG_LIMIT_S, cores: set[int] | None = None) -> Iterator[list[int]]:
    """`procs` processes that each spin one core for the block (at most `limit_s`), on `cores`
    (None: wherever the scheduler puts them); yields their PIDs."""
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    code = [sys.executable, "-c", _SPIN.format(limit=limit_s)]
    kids = [subprocess.Popen(code, start_new_session=True, preexec_fn=pin) for _ in range(procs)]
    try:
        yield [k.pid for k in kids]
    finally:
        for k in kids:
            k.kill()
            k.wait(timeout=10)


@contextlib.contextmanager
def load(name: str, procs: int = 1, cores: set[int] | None = None) -> Iterator[None]:
    """The machine as `name` says (one of LOADS): as it is, or beside `procs` busy loops on `cores`."""
    if name == "quiet":
        yield
        return
    with hog(procs, cores=cores):
        yield
