"""Warm spares: processes that have already imported torch and the worker, so that a failed
group is back in well under a second (a cold start spends seconds in imports)."""

import json
import sys
import threading
from typing import TYPE_CHECKING

from ftcore.launcher.procs import Proc

if TYPE_CHECKING:
    from ftcore.launcher.supervisor import Launcher


class SparePool:
    """Two groups' worth of spares (two failures in a row), refilled after each use."""

    def __init__(self, launcher: "Launcher"):
        self.launcher = launcher
        self.procs: list[Proc] = []

    def start_one(self) -> Proc:
        la = self.launcher
        argv = [sys.executable, "-m", "ftcore.launcher.child", "spare", la.cfg.worker, *la.spare_preload()]
        return la.spawn(argv, la.base_env(), "spare", stdin=True)

    def refill(self, delay: float = 0.0) -> None:
        # After a restart, wait: a new spare's imports would compete with the heal for CPU.
        la = self.launcher
        if la.stop.wait(delay):
            return
        if la.cfg.spares and not la.stop.is_set():
            with la.lock:
                need = 2 * la.cfg.ranks_per_group - len(self.procs)
            for _ in range(max(need, 0)):
                p = self.start_one()
                with la.lock:
                    self.procs.append(p)

    def refill_later(self, delay: float) -> None:
        threading.Thread(target=self.refill, args=(delay,), daemon=True).start()

    def take(self) -> list[Proc] | None:
        """One group's worth of ready spares, or None."""
        la = self.launcher
        with la.lock:
            ready = [p for p in self.procs if p.ready.is_set() and p.p.poll() is None]
            if len(ready) < la.cfg.ranks_per_group:
                return None
            take = ready[: la.cfg.ranks_per_group]
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
