"""Timelines the Lighthouse tab summarizes off the request path: one worker thread per process
runs one child at a time (`python -m training.timeline_summary`, the opened file as its stdin),
behind a bounded queue; results stay in a small LRU keyed by the file's identity.

A child, not the thread itself: json.loads of a 64 MiB timeline holds the GIL for seconds,
which would stall every request of the API server; a child runs niced and capped in memory,
is killed at a timeout, and hands its memory back when it exits. Nothing is written to the run folder."""

import json
import os
import subprocess
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

Result = tuple[dict[str, Any] | None, str]  # (bounded summary, or None and why)
Key = tuple[str, int, int, int, int]  # path, inode, size, mtime_ns, ctime_ns (ctime: no utime can set it)

SLOTS = 32  # results kept (each a bounded summary: well under 1 MiB)
QUEUE = 8  # timelines waiting for the worker; past that a view says "try again"
CHILD_TIMEOUT_S = float(os.environ.get("FTREC_TIMELINE_SUMMARY_TIMEOUT_S", "120"))
OUTPUT_MAX = 4 << 20  # a child's answer, bounded by training.timeline_summary.bounded
UNREADABLE = "this run's timeline.json is not a timeline the page can read: not shown"


def key(path: Path, st: os.stat_result) -> Key:
    return (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def in_child(fd: int, max_bytes: int) -> Result:
    """The timeline open as `fd` summarized by a child process (training.timeline_summary.main)."""
    from training import timeline_summary

    os.lseek(fd, 0, os.SEEK_SET)
    root = Path(timeline_summary.__file__).resolve().parent.parent  # the training the server imported
    argv = [sys.executable, "-m", "training.timeline_summary", "--max-bytes", str(max_bytes)]
    try:
        p = subprocess.run(argv, stdin=fd, capture_output=True, cwd=root, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"this run's timeline.json took over {CHILD_TIMEOUT_S:g} s to summarize: not shown"
    if p.returncode != 0 or len(p.stdout) > OUTPUT_MAX:
        return None, UNREADABLE
    try:
        return timeline_summary.bounded(json.loads(p.stdout)), ""
    except (ValueError, RecursionError):
        return None, UNREADABLE


class Summaries:
    """Results by Key, and one worker that fills them: `get`, `put`, `submit`."""

    def __init__(self, run: Callable[[int], Result], slots: int = SLOTS, queue: int = QUEUE) -> None:
        self._run, self._slots, self._most = run, slots, queue
        self._done: OrderedDict[Key, Result] = OrderedDict()
        self._waiting: deque[tuple[Key, int]] = deque()
        self._pending: set[Key] = set()
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None

    def get(self, k: Key) -> Result | None:
        with self._cond:
            if k in self._done:
                self._done.move_to_end(k)
            return self._done.get(k)

    def put(self, k: Key, result: Result) -> None:
        with self._cond:
            self._done[k] = result
            self._done.move_to_end(k)
            while len(self._done) > self._slots:
                self._done.popitem(last=False)

    def submit(self, k: Key, fd: int) -> bool:
        """Queue the file open as `fd` (duplicated: the caller keeps its own) to be summarized
        as `k`; False when the queue is full. A key already waiting is not queued twice."""
        with self._cond:
            if k in self._pending:
                return True
            if len(self._waiting) >= self._most:
                return False
            self._waiting.append((k, os.dup(fd)))
            self._pending.add(k)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="ftrec-timeline-summary", daemon=True)
                self._worker.start()
            self._cond.notify()
        return True

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._waiting:
                    self._cond.wait(timeout=60)
                if not self._waiting:
                    self._worker = None  # idle: a later submit starts another
                    return
                k, fd = self._waiting.popleft()
            try:
                result = self._run(fd)
            except Exception:  # whatever went wrong, the page says so; the worker lives on
                result = (None, UNREADABLE)
            finally:
                os.close(fd)
            self.put(k, result)
            with self._cond:
                self._pending.discard(k)
