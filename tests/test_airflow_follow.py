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


def _job(out: Path, seconds: float, log: Path) -> subprocess.Popen:
    (log.parent / "sleeper.py").write_text(SLEEPER)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{log.parent}", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        argv = [sys.executable, "-c", JOB, str(out), str(seconds)]
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
