"""Run a command for an Airflow task: its output streams into the task log, and when the task
ends (success, failure, timeout, kill from the UI) the command's whole process tree ends with
it. A detached command (`log_file`: the training job) outlives a task process that dies
without a word (kill -9, a lost worker): it writes to its file, not a pipe, and no parent-death
signal ends it, so a later try follows it (follow.py) instead of starting another.

The long form: docs/airflow.md, "plugins/ftrec_airflow/runner"."""

import collections
import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence

TERM_GRACE_S = float(os.environ.get("FTREC_TERM_GRACE_S", "10"))  # SIGTERM -> SIGKILL
TAIL_LINES = 20  # lines of output quoted in the error when the command fails

log = logging.getLogger(__name__)


class JobLeftRunning(RuntimeError):
    """This try ends and the detached job it started or follows runs on: Airflow will run the task
    again (a new scheduler reset it, a retry is due), and that try follows the job."""


class CommandFailed(RuntimeError):
    """The command exited non-zero; the message holds its last lines of output."""

    def __init__(self, cmd: Sequence[str], returncode: int, tail: list[str]):
        self.returncode = returncode
        self.tail = tail
        how = f"signal {-returncode}" if returncode < 0 else f"exit code {returncode}"
        last = "\n".join(tail[-TAIL_LINES:])
        super().__init__(f"{' '.join(cmd[:4])} ... failed with {how}; last output:\n{last}")


def _become_subreaper() -> bool:
    """Linux: orphans of our descendants (a daemon that left the command's process group,
    whose parent then exited) are re-parented to us instead of init, so we can still end
    them. Returns whether it worked."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1) == 0  # PR_SET_CHILD_SUBREAPER
    except OSError:
        return False


def _descendants() -> set[int]:
    import psutil  # an Airflow dependency; only needed here

    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def _end_strays(pids: set[int], grace_s: float, logger: logging.Logger) -> None:
    """SIGTERM, then SIGKILL after `grace_s`, the processes in `pids` still alive."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:  # already dead, re-parented to us: reap it
                os.waitpid(pid, os.WNOHANG)
                continue
            procs.append(p)
        except (psutil.Error, ChildProcessError):
            pass
    if not procs:
        return
    logger.warning(
        "ending %d process(es) the command left behind: %s", len(procs), ", ".join(f"{p.pid}" for p in procs)
    )
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def _reap(pgid: int) -> None:
    """Collect dead members of the group that became our children (we are a subreaper):
    a zombie still counts as a member of its group. The leader (pid == pgid) is left to
    Popen, which needs its exit status."""
    while True:
        try:
            info = os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == pgid:
            return
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:
            return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_group(proc: subprocess.Popen, grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM the command's process group, SIGKILL whatever is left after `grace_s`."""
    pgid = proc.pid  # start_new_session: group id == leader pid
    if not _group_alive(pgid):
        proc.poll()
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader so it does not linger as a zombie in the group
        _reap(pgid)
        if not _group_alive(pgid):
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    _reap(pgid)


class Command:
    """One running command. `run()` is the usual entry; keep a `Command` when something
    else (an operator's `on_kill`) must be able to stop it from another frame."""

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        logger: logging.Logger | None = None,
        on_line=None,
        log_file: str | os.PathLike | None = None,
    ):
        self.on_line = on_line  # called with every output line (e.g. to spot an address)
        self.log_file = log_file  # detached: its output is appended here and tailed into the log
        self.cmd = [str(c) for c in cmd]
        self.env = env
        self.cwd = cwd
        self.log = logger or log
        self.proc: subprocess.Popen | None = None
        self.left: str | None = None  # why a detached command was left running (`leave`)
        self.tail: collections.deque[str] = collections.deque(maxlen=200)

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._line(line.rstrip("\n"))

    def _tail(self, start: int) -> None:
        """A detached command's pump: its log file from `start` until it exits."""
        assert self.proc is not None and self.log_file is not None
        with open(self.log_file, "rb") as f:
            f.seek(start)
            while self.proc.poll() is None and self.left is None:
                drain(f, self._line)
                time.sleep(0.1)
            drain(f, self._line, final=True)

    def _line(self, line: str) -> None:
        self.tail.append(line)
        self.log.info("%s", line)
        if self.on_line is not None:
            try:
                self.on_line(line)
            except Exception:  # a watcher's bug must not stop the log pump
                self.log.exception("on_line callback failed")

    def _start(self) -> tuple[subprocess.Popen, threading.Thread]:
        """Start the command; it and the thread that streams its output."""
        from ftcore.util import procs  # here: DAG parsing imports this module, not ftcore

        # stdin from /dev/null: a task process's stdin is Airflow's request socket to its supervisor,
        # and a command holding it open (a detached job outliving the task process) keeps the
        # supervisor waiting for it to close after the task process died, reporting nothing
        kw: dict = dict(env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        kw["start_new_session"] = True
        if self.log_file is None:  # a child of this task: SIGTERM when the task process dies
            kw.update(stdout=subprocess.PIPE, text=True, bufsize=1, errors="replace")
            self.proc = subprocess.Popen(self.cmd, preexec_fn=procs.exec_with_parent_death_signal, **kw)
            return self.proc, threading.Thread(target=self._pump, name="ftrec-log-pump", daemon=True)
        with open(self.log_file, "ab") as out:  # closed here once the child holds it
            start = out.tell()
            self.proc = subprocess.Popen(self.cmd, stdout=out, **kw)
        return self.proc, threading.Thread(target=self._tail, args=(start,), name="ftrec-log-tail", daemon=True)

    def stop(self) -> None:
        if self.proc is not None and self.left is None:
            stop_group(self.proc)

    def leave(self, why: str) -> None:
        """Leave a detached command running when this process stops (a SIGTERM from Airflow for a
        task it will run again): `run()` then raises JobLeftRunning and `stop()` does nothing."""
        if self.log_file is not None:
            self.left = why

    def run(self, timeout_s: float | None = None) -> None:
        """Run to completion; raise `CommandFailed` on a non-zero exit, `TimeoutError`
        past `timeout_s`. The process group is gone when this returns or raises, except after
        `leave` (JobLeftRunning). On SIGTERM a detached command asks the handler it replaces first
        (the task's: it may `leave` the job to the next try), then stops unless left."""
        self.log.info("running: %s", " ".join(self.cmd))
        reaper = _become_subreaper()
        before = _descendants() if reaper else set()
        proc, pump = self._start()
        pump.start()
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGTERM)

            def _on_term(signum, frame):
                if self.log_file is not None and callable(previous):
                    previous(signum, frame)  # the task's handler may leave the job running (`leave`)
                if self.left is None:
                    self.log.warning("task terminated: stopping process group %d", proc.pid)
                    self.stop()
                if self.log_file is None and callable(previous):
                    previous(signum, frame)

            signal.signal(signal.SIGTERM, _on_term)
        start = time.monotonic()
        try:
            # Wait in short slices so the main thread keeps handling signals (Airflow's
            # execution timeout is a SIGALRM that raises here).
            while True:
                try:
                    proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    if self.left is not None:
                        raise JobLeftRunning(self.left) from None
                    if timeout_s is not None and time.monotonic() - start > timeout_s:
                        raise TimeoutError(f"{self.cmd[0]} ran past {timeout_s:.0f} s") from None
        finally:
            if self.left is None:  # (a job left running is the next try's to follow)
                stop_group(proc)  # also reaps grandchildren left behind by a clean exit
                if reaper:  # and whatever escaped the group (its own session) but was ours
                    _end_strays(_descendants() - before - {proc.pid}, TERM_GRACE_S, self.log)
            pump.join(timeout=5)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if proc.returncode != 0:
            raise CommandFailed(self.cmd, proc.returncode, list(self.tail))


def drain(f, emit, final: bool = False) -> None:
    """Emit each whole line appended to the binary file `f` since the last call; a last
    partial one only when `final` (until then it is still being written)."""
    while line := f.readline():
        if not line.endswith(b"\n") and not final:
            f.seek(-len(line), os.SEEK_CUR)
            return
        emit(line.decode(errors="replace").rstrip("\n"))


def run(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    logger: logging.Logger | None = None,
    timeout_s: float | None = None,
) -> list[str]:
    """Run `cmd` streaming its output to `logger`; return its last lines of output."""
    c = Command(cmd, env=env, cwd=cwd, logger=logger)
    c.run(timeout_s)
    return list(c.tail)
