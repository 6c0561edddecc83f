"""ftcore's launcher on its own: ftcore.launcher.Launcher runs the toy worker without the trainer's
front end (training/launch.py), and ftcore imports nothing of the rest of the repository."""

import ast
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ROOT, run_python

from ftcore.launcher import TOY, LaunchConfig, Launcher, lease

OTHERS = {"training", "dataprep", "ftrec_airflow", "benchmarks", "dags"}

# The launch in a process of its own: what it imported is printed as its last line.
SCRIPT = """
import json, sys
from ftcore.launcher import LaunchConfig, Launcher
cfg = LaunchConfig(replica_groups=2, out=sys.argv[1], faults=sys.argv[2], timeout=120,
                   extra=["--steps", "30", "--step-sleep", "0.04"])
code = Launcher(cfg).run()
print("imported", json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[3:]))))
sys.exit(code)
"""


def imports(folder: Path) -> dict[str, set[str]]:
    """Each module file under folder -> the top-level packages it imports."""
    out = {}
    for path in folder.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(ROOT))] = names
    return out


def test_ftcore_imports_nothing_of_the_repository_and_training_no_airflow_glue():
    ftcore = {f: n & OTHERS for f, n in imports(ROOT / "ftcore").items() if n & OTHERS}
    assert not ftcore, f"ftcore depends on nothing else in the repository: {ftcore}"
    training = {f: n & {"ftrec_airflow"} for f, n in imports(ROOT / "training").items() if "ftrec_airflow" in n}
    assert not training, f"training imports the Airflow glue: {training}"


def test_the_worker_module_is_a_parameter(tmp_path):
    """The base launcher runs any module: `-m MODULE` with the toy's arguments; a spare preloads
    only the worker unless a front end names more."""
    la = Launcher(LaunchConfig(out=str(tmp_path), worker="some.worker", shards="/data", extra=["--x", "1"]))
    assert la.worker_argv(1) == ["--out", str(tmp_path), "--shards", "/data", "--x", "1"]
    assert la.spare_preload() == [] and la.worker_module() == "some.worker"
    words = la.torchrun_command(1).split()
    assert words[words.index("-m") + 1 :] == ["some.worker", *la.worker_argv(1)]
    assert LaunchConfig().worker == TOY


@pytest.mark.integ
@pytest.mark.slow
def test_ftcore_launcher_alone_restarts_a_killed_toy_group_that_heals_identical(tmp_path):
    out, plan = tmp_path / "run", tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"kind": "kill", "group": 1, "at_step": 10}]}))
    r = run_python(["-c", SCRIPT, str(out), str(plan), *sorted(OTHERS)], 180)
    assert r.returncode == 0, r.stdout[-4000:]
    assert r.stdout.strip().splitlines()[-1] == "imported []", r.stdout[-2000:]
    assert not (out / "timeline.json").exists(), "the timeline is the trainer front end's, not ftcore's"
    started = [json.loads(x.split(" ", 2)[2]) for x in r.stdout.splitlines() if x.startswith("[launch] group_started ")]
    restarted = [e["group"] for e in started if e["incarnation"] == 1]
    assert restarted == [1], r.stdout[-3000:]
    s0, s1 = ((out / f"replica_{g}" / "state.safetensors").read_bytes() for g in (0, 1))
    assert s0 == s1, "the restarted group did not heal to the other group's state"


# ---- one job per run folder: the launcher's lease ------------------------------------------------

NOW = 1_000_000.0
HOLDER = lease.Holder("h1", "boot1", 4242, 777, 4242, "job", (0, 1), NOW - 600, NOW - 5)


@pytest.mark.parametrize(
    "holder, here, verdict",
    [
        (None, lease.Local("h1", "boot1", None), lease.Take),  # nobody recorded
        (HOLDER, lease.Local("h1", "boot1", 777), lease.Keep),  # same host, same process: alive
        (HOLDER, lease.Local("h1", "boot1", None), lease.Take),  # same host, pid gone
        (HOLDER, lease.Local("h1", "boot1", 999), lease.Take),  # same host, pid reused by another process
        (HOLDER, lease.Local("h1", "boot2", 777), lease.Take),  # same host name, rebooted since
        (HOLDER, lease.Local("h2", "boot9", None), lease.Keep),  # another host, heartbeat 5 s old
        (replace(HOLDER, heartbeat=NOW - 61), lease.Local("h2", "boot9", None), lease.Take),  # ... 61 s old
    ],
)
def test_a_lease_is_taken_only_from_a_provably_dead_holder(holder, here, verdict):
    assert isinstance(lease.judge(holder, here, NOW, stale_after=60.0), verdict)


def test_the_lease_record_parses_and_names_the_field_at_fault(tmp_path):
    assert lease.Holder.parse(json.loads(json.dumps(HOLDER.to_wire()))) == HOLDER
    with pytest.raises(ValueError, match="'pid'"):
        lease.Holder.parse({**HOLDER.to_wire(), "pid": "4242"})


def test_a_stale_lease_of_another_host_is_taken_a_fresh_one_refused(tmp_path):
    """Real files and locks: a record another host left, fresh, then stale; a dead local pid's."""
    theirs = lease.RunLease(str(tmp_path), [0], "job")
    other = replace(HOLDER, host="elsewhere", groups=(0,), heartbeat=time.time())
    (tmp_path / "lease").mkdir()
    (tmp_path / "lease" / "group-0.json").write_text(json.dumps(other.to_wire()))
    with pytest.raises(lease.LeaseHeld, match=r"group 0 .* launcher pid 4242 on host elsewhere .* within"):
        theirs.acquire()
    (tmp_path / "lease" / "group-0.json").write_text(json.dumps(replace(other, heartbeat=time.time() - 3600).to_wire()))
    mine = theirs.acquire()
    assert theirs.read(0) == mine and "beyond FTCORE_RUN_LEASE_STALE" in theirs.taken_over[0]
    # while held here, a second lease in this very process is refused by the lock
    with pytest.raises(lease.LeaseHeld, match="it holds the lock"):
        lease.RunLease(str(tmp_path), [1, 0], "job").acquire()
    assert theirs.beat() is None and theirs.read(0).heartbeat >= mine.heartbeat
    (tmp_path / "lease" / "group-0.json").write_text(json.dumps(other.to_wire()))  # taken over behind its back
    assert "now held by launcher pid 4242 on host elsewhere" in (theirs.beat() or "")
    theirs.release()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    local = replace(HOLDER, host=socket.gethostname(), boot_id=lease.boot_id(), pid=int(dead.stdout))
    (tmp_path / "lease" / "group-0.json").write_text(json.dumps(local.to_wire()))
    again = lease.RunLease(str(tmp_path), [0], "job")
    again.acquire()
    assert "is gone" in again.taken_over[0] or "another process now" in again.taken_over[0]
    again.release()
    assert not (tmp_path / "lease" / "group-0.json").exists()


# A launch of the toy that lives until killed (A, C) or is refused at once (B).
LONG = """
import sys
from ftcore.launcher import LaunchConfig, Launcher
cfg = LaunchConfig(replica_groups=1, out=sys.argv[1], timeout=120, spares=False,
                   extra=["--steps", "100000", "--step-sleep", "0.05"])
sys.exit(Launcher(cfg).run())
"""


def _start_launch(out: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FTCORE_RUN_LEASE_HEARTBEAT": "0.2"}
    with open(log, "w") as f:
        argv = [sys.executable, "-c", LONG, str(out)]
        return subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _until(cond, within_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {within_s:.0f}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


@pytest.mark.integ
def test_a_second_launcher_on_a_live_folder_is_refused_and_a_killed_ones_folder_taken_over(tmp_path):
    """A runs; B on A's folder is refused (its token untouched, nothing started); A is killed -9,
    C takes the folder over; C, its lease taken over behind its back, stops."""
    out = tmp_path / "run"
    a = _start_launch(out, tmp_path / "a.log")
    c = None
    try:
        _until(
            lambda: "group_started" in (tmp_path / "a.log").read_text(), 60, "group started by A", tmp_path / "a.log"
        )
        token = (out / "token").read_bytes()
        b = run_python(["-c", LONG, str(out)], 60)
        assert b.returncode != 0 and "group_started" not in b.stdout, b.stdout[-2000:]
        assert f"is held by launcher pid {a.pid} on host {socket.gethostname()}" in b.stdout, b.stdout[-2000:]
        assert "One job per run folder" in b.stdout and (out / "token").read_bytes() == token
        os.killpg(a.pid, signal.SIGKILL)
        a.wait(10)
        c = _start_launch(out, tmp_path / "c.log")
        _until(
            lambda: "group_started" in (tmp_path / "c.log").read_text(), 60, "group started by C", tmp_path / "c.log"
        )
        assert f"its pid {a.pid} is gone" in (tmp_path / "c.log").read_text()
        record = json.loads((out / "lease" / "group-0.json").read_text())
        assert record["pid"] == c.pid and (out / "token").read_bytes() != token
        for _ in range(30):  # C's heartbeat may rewrite its record between its check and our write: again
            (out / "lease" / "group-0.json").write_text(json.dumps({**record, "host": "elsewhere", "pid": 1}))
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.wait(1)
                break
        assert c.returncode == 1
        assert "lease_lost" in (tmp_path / "c.log").read_text()
    finally:
        for p in (a, c):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
