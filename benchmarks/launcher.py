"""One launcher run for the ftcore benchmarks: `python -m training launch` with a fault plan,
bounded in time and in its own session, and the timeline it wrote.

    tl = launch(out, faults, toy(steps=300, step_sleep=0.03), env={"FTCORE_LEASE": "0"})
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def toy(steps: int, step_sleep: float, dim: int = 64) -> tuple[list[str], list[str]]:
    """(launcher options, worker arguments) for ftcore's toy trainer."""
    return ["--worker", "ftcore.examples.toy"], [
        "--steps",
        str(steps),
        "--step-sleep",
        str(step_sleep),
        "--dim",
        str(dim),
    ]


def launch(
    out: str,
    faults: list[dict],
    worker: tuple[Sequence[str], Sequence[str]],
    *,
    groups: int = 3,
    options: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = 400,
) -> dict:
    """Run the launcher into `out` (the plan goes beside it) and return its timeline.json, with
    the run's wall time as "wall_s". `worker`: (launcher options, worker arguments) such as
    `toy(...)`; `options`: more launcher options. RuntimeError with the log's tail on failure."""
    plan = out + "-plan.json"
    Path(plan).write_text(json.dumps({"faults": faults}))
    worker_options, worker_args = worker
    args = [sys.executable, "-m", "training", "launch", "--replica-groups", str(groups), "--out", out]
    args += ["--faults", plan, "--timeout", str(timeout), *worker_options, *options, "--", *worker_args]
    t0 = time.monotonic()
    p = subprocess.Popen(
        args,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = p.communicate(timeout=timeout + 60)  # the launcher's own --timeout ends its groups first
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the launcher and every group it started
        p.communicate()
        raise
    if p.returncode != 0:
        raise RuntimeError(f"launcher failed ({p.returncode}):\n{log[-3000:]}")
    tl = json.loads(Path(out, "timeline.json").read_text())
    tl["wall_s"] = time.monotonic() - t0
    return tl
