"""The launcher's child processes: each in a session of its own, its output copied with a prefix."""

import os
import signal
import subprocess
import sys
import threading

SPARE_READY = "ftrec-spare-ready"  # a warm spare's line on stdout once its imports are done


class Proc:
    """A child process whose output is copied line by line with a prefix."""

    def __init__(
        self, argv: list[str], env: dict[str, str], prefix: str, out_lock: threading.Lock, stdin: bool = False
    ):
        self.prefix = prefix
        self.p = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            start_new_session=True,
            text=True,
            bufsize=1,
        )
        self.ready = threading.Event()
        self.replace_group = False  # its group is unhealthy while alive (a hang): kill and restart it
        self.planned_kill = False  # killed by the fault plan (kill_lighthouse): not a death to repair
        self._lock = out_lock
        threading.Thread(target=self._pump, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.p.pid

    def send(self, line: str) -> None:
        """A line on its stdin (a spare's assignment)."""
        if self.p.stdin is None:
            raise RuntimeError(f"{self.prefix}: started without a stdin pipe")
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def _pump(self) -> None:
        if self.p.stdout is None:  # Popen(stdout=PIPE) always has it
            return
        for line in self.p.stdout:
            if line.startswith(SPARE_READY):
                self.ready.set()
                continue
            with self._lock:
                sys.stdout.write(f"[{self.prefix}] {line}" if line.endswith("\n") else f"[{self.prefix}] {line}\n")
                sys.stdout.flush()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.p.pid, sig)  # its own session: the rank and anything it started
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        try:
            self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class ProcessTable:
    """Every child a launch starts, so that a stopped launch leaves nothing behind."""

    def __init__(self, out_lock: threading.Lock, stop: threading.Event):
        self.out_lock = out_lock
        self.stop = stop
        self.children: list[Proc] = []
        self._lock = threading.Lock()

    def spawn(self, argv: list[str], env: dict[str, str], prefix: str, stdin: bool = False) -> Proc:
        with self._lock:
            self.children = [c for c in self.children if c.p.poll() is None]
            p = Proc(argv, env, prefix, self.out_lock, stdin=stdin)
            self.children.append(p)
        if self.stop.is_set():  # started by a supervisor thread while the launch was ending
            p.kill()
        return p

    def kill_all(self) -> None:
        """SIGKILL every child that still runs, whatever list it is on now."""
        with self._lock:
            alive = [c for c in self.children if c.p.poll() is None]
        for p in alive:
            p.kill()
