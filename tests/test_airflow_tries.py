"""The train task's log says what ended its previous try: a try killed by SIGKILL (a real
process, a real kill -9) is told apart from one that ended in a way it could record, and
whether the kernel's OOM killer acted is read from the cgroup, not guessed."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ftrec_airflow import tries

ROOT = Path(__file__).resolve().parent.parent
TRY = """
import sys, time
from ftrec_airflow import tries
with tries.recorded(sys.argv[1]):
    print("running", flush=True)
    if sys.argv[2] == "fail":
        raise RuntimeError("the launcher failed with exit code 1")
    time.sleep(60)
"""


def _try(out: Path, how: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}"}
    return subprocess.Popen(
        [sys.executable, "-c", TRY, str(out), how], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )


def test_the_next_try_says_a_killed_try_was_killed_and_whether_memory_ran_out(tmp_path):
    first = _try(tmp_path, "sleep")
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "running"
        record = json.loads((tmp_path / tries.RECORD).read_text())
        alive = tries.explain(record, tries.oom_kills())
        assert f"task process {first.pid} " in (alive or "") and "is still running" in (alive or "")
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # kill -9 of the try's process
        first.wait(10)
    told: list[str] = []
    with tries.recorded(tmp_path, told.append):
        pass
    assert f"task process {first.pid} " in told[0] and "killed by a signal it cannot catch (SIGKILL" in told[0], told
    assert ("not out of memory" in told[0]) == (tries.oom_kills() is not None), told
    # a try that ends in a way it sees says how; the next try repeats it
    failing = _try(tmp_path, "fail")
    assert failing.wait(60) != 0
    told = []
    with pytest.raises(ValueError), tries.recorded(tmp_path, told.append):
        raise ValueError("second")
    assert len(told) == 1 and "ended: RuntimeError: the launcher failed with exit code 1" in told[0], told
    assert json.loads((tmp_path / tries.RECORD).read_text())["ended"] == "ValueError: second"
