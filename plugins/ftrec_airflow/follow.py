"""A later try of the train task follows a live training job to its end instead of starting
another beside it.

The job's identity is the launcher's lease in the run folder (`<out>/lease/group-0.json`,
ftcore/launcher/lease.py: host, pid and its start time, session, job id, heartbeat). A try whose
predecessor's task process was lost (its supervisor killed, the worker redeployed) while the
launcher lives on finds that holder alive and waits for it, and the task's kill (`on_kill`)
stops it: SIGTERM to the launcher's session, SIGKILL after the grace period. Only a job that is
gone is started again (resumed from its checkpoints)."""

import contextlib
import os
import signal
import socket
import time
from pathlib import Path

from ftcore import timeouts
from ftcore.launcher import lease
from ftrec_airflow import runner

LOG_NAME = "launcher.log"  # in the run folder: the detached launcher's output (runner.Command)
POLL_S = 1.0  # how often a follower looks at the job
SAY_EVERY_S = 60.0  # how often it says in the task log that the job still runs
TERM_GRACE_S = float(os.environ.get("FTREC_TERM_GRACE_S", "10"))  # the runner's SIGTERM -> SIGKILL
# The train task's state when Airflow stops a try by SIGTERM, that says Airflow runs the task again
# (or still does): a new scheduler reset it as orphaned (None, then scheduled, queued, running as a new
# try), a retry is due, or the worker is going down under a running try. The job is left to the next
# try then. Any other state (failed, success, restarting: a person cleared it or marked it) stops it.
RUNS_AGAIN = frozenset({None, "scheduled", "queued", "running", "up_for_retry", "up_for_reschedule", "deferred"})


def left_for_next_try(state: str | None) -> str | None:
    """Why a try stopped by Airflow in the task state `state` leaves its job running, or None: stop it."""
    if state not in RUNS_AGAIN:
        return None
    return (
        f"Airflow stopped this try with the task {state or 'reset (no state)'}: it runs the task again, and that "
        "try follows the training job, which runs on"
    )


def live_job(out: str | Path) -> lease.Holder | None:
    """The launcher that holds the run folder `out` and lives (its lease cannot be taken from
    it), or None: no job, or one that is gone."""
    holder = lease.RunLease(str(out), [0], "").read(0)
    if holder is None:
        return None
    here = lease.Local(socket.gethostname(), lease.boot_id(), lease.start_time(holder.pid))
    verdict = lease.judge(holder, here, time.time(), timeouts.RUN_LEASE_STALE)
    return holder if isinstance(verdict, lease.Keep) else None


class Follower:
    """Follows the live job `holder` of run folder `out`; `stop()` ends it (the task's on_kill)."""

    def __init__(self, out: str | Path, holder: lease.Holder, log=print, echo=None):
        self.out, self.holder, self.log = Path(out), holder, log
        self.echo = echo  # each new line of the job's log (LOG_NAME), as it follows
        self.local = holder.host == socket.gethostname() and holder.boot_id == lease.boot_id()
        self.left: str | None = None  # why this try stopped following and left the job running (`leave`)

    def leave(self, why: str) -> None:
        """Stop following, and leave the job running (`wait` raises runner.JobLeftRunning)."""
        self.left = why

    def same_job(self) -> bool:
        now = live_job(self.out)
        return now is not None and (now.host, now.pid, now.start) == (
            self.holder.host,
            self.holder.pid,
            self.holder.start,
        )

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the job ends (its launcher is gone or let go of the folder); TimeoutError past `timeout_s`."""
        h = self.holder
        self.log(
            f"following the training job already running in {self.out}: launcher pid {h.pid} on {h.host} "
            f"(session {h.session}, job {h.job_id}), started by an earlier try; not starting another"
        )
        with contextlib.ExitStack() as stack:
            path = self.out / LOG_NAME
            f = stack.enter_context(open(path, "rb")) if self.echo is not None and path.exists() else None
            if f is not None:
                f.seek(0, os.SEEK_END)  # from now on: what came before is in the earlier try's log
            start = said = time.monotonic()
            while self.same_job():
                if self.left is not None:
                    raise runner.JobLeftRunning(self.left)
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    raise TimeoutError(f"the followed job (launcher pid {h.pid}) ran past {timeout_s:.0f} s")
                if time.monotonic() - said > SAY_EVERY_S:
                    self.log(f"the job (launcher pid {h.pid}) still runs, {time.monotonic() - start:.0f} s followed")
                    said = time.monotonic()
                if f is not None:
                    runner.drain(f, self.echo)
                time.sleep(POLL_S)
            if f is not None:
                runner.drain(f, self.echo, final=True)
        self.log(f"the followed job (launcher pid {h.pid}) has ended")

    def stop(self) -> None:
        """End the job: SIGTERM to the launcher's session, SIGKILL to what is left after the grace;
        nothing once the job was left to the next try (`leave`)."""
        if self.left is not None:
            return
        if not self.local:
            self.log(f"cannot stop launcher pid {self.holder.pid} on {self.holder.host} from here")
            return
        h = self.holder
        if lease.start_time(h.pid) != h.start:
            return  # gone already; the pid may be another process's now
        for sig, grace in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 5.0)):
            try:  # its whole session when it leads one (the runner starts it so), else itself
                os.killpg(h.session, sig) if h.session == h.pid else os.kill(h.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                if lease.start_time(h.pid) != h.start:
                    return
                time.sleep(0.05)
