"""A later try of the train task follows the job an earlier try started instead of starting
another, and the task's kill stops it: real launcher processes (the toy worker), found by their
lease in the run folder, followed to their end or stopped."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftrec_airflow import follow

ROOT = Path(__file__).resolve().parent.parent
JOB = """
import sys
from ftcore.launcher import LaunchConfig, Launcher
cfg = LaunchConfig(replica_groups=1, out=sys.argv[1], timeout=120, spares=False, worker="sleeper",
                   extra=["--seconds", sys.argv[2]])
sys.exit(Launcher(cfg).run())
"""
# every rank of the job: a worker that trains nothing (no torch to import), sleeps, then says so
SLEEPER = """
import pathlib, sys, time
def main(argv):
    time.sleep(float(argv[argv.index("--seconds") + 1]))
    pathlib.Path(argv[argv.index("--out") + 1], "slept").write_text("done")
    return 0
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
"""


# a task process: starts the job as the train task does (detached), then waits on it
TASK = """
import sys
from ftrec_airflow import runner
runner.Command([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], log_file=sys.argv[4]).run()
"""


def _job(out: Path, seconds: float, log: Path, task: bool = False) -> subprocess.Popen:
    (log.parent / "sleeper.py").write_text(SLEEPER)
    path = os.pathsep.join([str(ROOT), str(ROOT / "plugins"), str(log.parent)])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        argv = [sys.executable, "-c", JOB, str(out), str(seconds)]
        if task:
            out.mkdir(parents=True, exist_ok=True)
            argv = [sys.executable, "-c", TASK, JOB, str(out), str(seconds), str(out / follow.LOG_NAME)]
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _holder(out: Path, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + 60
    while (h := follow.live_job(out)) is None or h.pid != proc.pid:
        if time.monotonic() > deadline or proc.poll() is not None:
            pytest.fail(f"the job never held {out}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return h


@pytest.mark.integ
def test_a_later_try_follows_the_live_job_to_its_end_and_its_kill_stops_it(tmp_path):
    out, said = tmp_path / "run", []
    job = _job(out, 2.0, tmp_path / "job.log")
    try:
        holder = _holder(out, job, tmp_path / "job.log")
        assert holder.session == job.pid and holder.job_id == "default"
        follow.Follower(out, holder, said.append).wait(120)
        # it returned once the job had finished, not before: its worker's last word is there
        assert (out / "slept").read_text() == "done", (tmp_path / "job.log").read_text()[-3000:]
        assert job.wait(30) == 0 and follow.live_job(out) is None
        assert f"launcher pid {job.pid}" in said[0] and "not starting another" in said[0]
        # the task's kill (on_kill) stops the job it follows
        job = _job(out, 600, tmp_path / "job2.log")
        holder = _holder(out, job, tmp_path / "job2.log")
        follow.Follower(out, holder, said.append).stop()
        assert job.wait(15) != 0 and follow.live_job(out) is None
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)


@pytest.mark.integ
def test_the_job_outlives_its_task_process_killed_and_the_next_try_follows_it(tmp_path):
    """kill -9 of the task process that started the job (a lost worker, a killed task runner):
    the detached launcher trains on (no parent-death signal, no pipe to break), and a later
    try follows it to its end, its log streaming into the try's; nothing is started twice."""
    out, said, lines = tmp_path / "run", [], []
    task = _job(out, 6.0, tmp_path / "task.log", task=True)
    holder = None
    try:
        holder = _holder_of_any(out, task, tmp_path / "task.log")
        assert holder.pid != task.pid and holder.session == holder.pid  # the job, in its own session
        os.kill(task.pid, signal.SIGKILL)
        assert task.wait(10) == -signal.SIGKILL
        assert follow.live_job(out) == holder  # alive after its task process died
        follow.Follower(out, holder, said.append, echo=lines.append).wait(120)
        assert (out / "slept").read_text() == "done"  # trained to its end, once
        assert any("group_finished" in ln for ln in lines), lines  # its last words, said after the kill
        assert follow.live_job(out) is None
    finally:
        if holder is not None and lease_alive(holder):
            os.killpg(holder.session, signal.SIGKILL)


def _holder_of_any(out: Path, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + 60
    while (h := follow.live_job(out)) is None:
        if time.monotonic() > deadline or proc.poll() is not None:
            pytest.fail(f"the job never held {out}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return h


def lease_alive(holder) -> bool:
    from ftcore.launcher import lease

    return lease.start_time(holder.pid) == holder.start


# a task process whose SIGTERM handler is the task's (decorators._sigterm_asks_airflow): Airflow says
# it runs the task again, so the handler leaves the detached job running for the next try
LEAVING_TASK = """
import signal, sys
from ftrec_airflow import runner
cmd = runner.Command([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], log_file=sys.argv[4])
signal.signal(signal.SIGTERM, lambda signum, frame: cmd.leave("Airflow runs the task again"))
try:
    cmd.run()
except runner.JobLeftRunning as e:
    print("left running:", e, flush=True)
    sys.exit(3)
"""


@pytest.mark.integ
def test_a_try_airflow_stops_for_another_leaves_the_job_to_it(tmp_path):
    """Airflow's SIGTERM to a try it replaces (a new scheduler reset the task, a retry is due): the
    task's handler leaves the job running, the try ends at once (JobLeftRunning), and the job, which
    never held the task's stdin (Airflow's request socket), trains on for the next try to follow."""
    out = tmp_path / "run"
    out.mkdir()
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins"), str(tmp_path)])}
    argv = [sys.executable, "-c", LEAVING_TASK, JOB, str(out), "3", str(out / follow.LOG_NAME)]
    with open(tmp_path / "task.log", "w") as log:
        task = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    holder = None
    try:
        holder = _holder_of_any(out, task, tmp_path / "task.log")
        assert os.readlink(f"/proc/{holder.pid}/fd/0") == "/dev/null"
        task.send_signal(signal.SIGTERM)
        assert task.wait(10) == 3, (tmp_path / "task.log").read_text()[-3000:]
        assert follow.live_job(out) == holder  # left running
        follow.Follower(out, holder, print).wait(120)
        assert (out / "slept").read_text() == "done"  # trained to its end, once
    finally:
        if holder is not None and lease_alive(holder):
            os.killpg(holder.session, signal.SIGKILL)
        if task.poll() is None:
            os.killpg(task.pid, signal.SIGKILL)
            task.wait(10)


def test_which_task_states_leave_the_job_to_the_next_try():
    """None (reset by a new scheduler), scheduled, queued, running, up_for_retry: Airflow runs the
    task again, so its job is left to that try; a person's clear (restarting) or mark (failed,
    success), or an unanswered question, stops it."""
    from ftrec_airflow import decorators

    for state in (None, "scheduled", "queued", "running", "up_for_retry", "deferred"):
        assert follow.left_for_next_try(state), state
    for state in ("restarting", "failed", "success", "skipped", "upstream_failed", "removed", decorators._UNKNOWN):
        assert follow.left_for_next_try(state) is None, state

    class TI:
        dag_id, task_id, run_id, map_index = "d", "train", "r", -1

        @staticmethod
        def get_task_states(**kw):
            assert kw == {"dag_id": "d", "task_ids": ["train"], "run_ids": ["r"], "map_index": None}
            return {"r": {"train": None}}

    assert decorators._state_now(TI()) is None
    TI.get_task_states = staticmethod(lambda **kw: 1 / 0)  # outside a supervised task, say
    assert decorators._state_now(TI()) == decorators._UNKNOWN
