"""Warm spares: processes that have already imported torch and the worker, so that a failed
group is back in well under a second (a cold start spends seconds in imports)."""

import json
import threading
from collections.abc import Callable

from ftcore.launcher.procs import Proc


class SparePool:
    """Two groups' worth of spares (two failures in a row), refilled after each use. `start`
    starts one spare; `lock` and `stop` are the launcher's."""

    def __init__(
        self, start: Callable[[], Proc], per_group: int, enabled: bool, lock: threading.Lock, stop: threading.Event
    ):
        self.start, self.per_group, self.enabled = start, per_group, enabled
        self.lock, self.stop = lock, stop
        self.procs: list[Proc] = []

    def refill(self, delay: float = 0.0) -> None:
        # After a restart, wait: a new spare's imports would compete with the heal for CPU.
        if self.stop.wait(delay):
            return
        if self.enabled and not self.stop.is_set():
            with self.lock:
                need = 2 * self.per_group - len(self.procs)
            for _ in range(max(need, 0)):
                p = self.start()
                with self.lock:
                    self.procs.append(p)

    def refill_later(self, delay: float) -> None:
        threading.Thread(target=self.refill, args=(delay,), daemon=True).start()

    def take(self) -> list[Proc] | None:
        """One group's worth of ready spares, or None."""
        with self.lock:
            ready = [p for p in self.procs if p.ready.is_set() and p.p.poll() is None]
            if len(ready) < self.per_group:
                return None
            take = ready[: self.per_group]
            self.procs = [p for p in self.procs if p not in take]
            return take

    @staticmethod
    def assign(p: Proc, prefix: str, env: dict[str, str], argv: list[str]) -> None:
        """A spare becomes a rank: its environment and arguments on its stdin."""
        p.prefix = prefix
        p.send(json.dumps({"env": env, "argv": argv}))

    def kill_all(self) -> None:
        for p in self.procs:
            p.kill()
