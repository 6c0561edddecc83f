"""Exactly-once across a whole-job resume: the make-up work a group owes travels in the
checkpoints, and the ledger drops what an earlier attempt recorded past the resume point.

Attempt 1 (`python -m training launch`, 2 groups x 1 rank): group 1 is killed with SIGKILL
mid-epoch 0 and its replacement never comes up (it hangs in its start-up: SIGSTOP), so
group 0 trains alone and group 1 owes the batches it missed. The whole job is stopped
(SIGINT to the launcher, which SIGKILLs every group) while group 0 is in a step after its
last checkpoint and before the end of the epoch, where make-up work runs: its ledger then
holds steps the resumed job trains again. Attempt 2 relaunches the job with
train.resume=true, as an Airflow retry does: group 0 resumes from its newest checkpoint,
group 1 from an older one and heals to group 0's step, and the job runs to the end. The
ledger over both attempts shows every sample of both epochs trained exactly once, and
group 1 makes up in attempt 2 the batches it missed in attempt 1."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import cli_shard_set, launch_args, run_launch, shard_sample_ids

from dataprep import schema
from ftcore import ledger
from ftcore.schedule import MakeupSchedule
from training import checkpoint

ROOT = Path(__file__).resolve().parent.parent
# Steps (an epoch of the synthetic set below has 9): group 1 is killed at KILL_AT; group 0's
# last checkpoint in attempt 1 is at CKPT, it records steps up to PAST_CKPT and is stopped
# in the next one (a `slow` fault holds it there).
KILL_AT, CKPT, PAST_CKPT = 3, 6, 7
TRAIN_ARGS = [
    "train.epochs=2",
    f"train.checkpoint_every={CKPT // 2}",
    "model.dim=16",
    "loss.kind=sampled_softmax",
    "loss.num_negatives=16",
    "mlflow.log_model=false",
    "mlflow.plots=false",
    "eval.batch_size=256",
    "eval.periodic=false",
]


def launch_until(args: list[str], done: Callable[[], bool], timeout: float) -> str:
    """Run the launcher (launch_args) until `done()`, then stop the whole job with SIGINT (the launcher
    SIGKILLs every group it started); returns its output."""
    p = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    lines: list[str] = []

    def pump() -> None:
        assert p.stdout is not None  # Popen(stdout=PIPE)
        for line in p.stdout:
            lines.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout
        while not done():
            if p.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"launcher: the awaited state was not reached (exit {p.poll()}):\n{''.join(lines)[-5000:]}")
            time.sleep(0.1)
    finally:
        # SIGINT first, also on failure: the launcher SIGKILLs its groups, the hung one included
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    reader.join(timeout=5)
    log = "".join(lines)
    # every rank the launcher started is gone with it (the hung one too): none outlives the job
    pids = [
        pid
        for m in re.finditer(r'group_started .*"pids": \[([0-9, ]+)\]', log)
        for pid in map(int, m.group(1).split(","))
    ]
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.killpg(pid, signal.SIGKILL)
    assert pids and not left, f"the launcher left ranks {left} running after it stopped"
    return log


def _alive(pid: int) -> bool:
    """Running or stopped, not a zombie waiting for its (gone) parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def records(folder: Path, writer: list[int] | None = None) -> list[dict]:
    """The ledger's current records (of one writer)."""
    if not folder.is_dir():
        return []
    return [r for r, sup in ledger.read(str(folder)) if not sup and writer in (None, r["writer"])]


@pytest.mark.integ
@pytest.mark.slow
def test_whole_job_resume_makes_up_missed_batches_exactly_once(tmp_path):
    shards, out = cli_shard_set(tmp_path), tmp_path / "run"
    steps = json.loads((shards / schema.MANIFEST).read_text())["steps"]
    assert steps > PAST_CKPT + 1, f"the shard set has {steps} steps per epoch: the stop must fall inside epoch 0"

    # ---- attempt 1: group 1 down from KILL_AT on, the job stopped after PAST_CKPT ------------
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps(
            {
                "faults": [
                    {"kind": "kill", "group": 1, "at_step": KILL_AT},
                    # its replacement (a cold start: --no-spares) hangs before it ever reaches the lighthouse
                    {"kind": "stop", "group": 1, "incarnation": 1, "at_time": 0, "duration_s": 0},
                    # group 0 holds in the step after PAST_CKPT until the job is stopped
                    {"kind": "slow", "group": 0, "at_step": PAST_CKPT + 1, "until_step": PAST_CKPT + 2, "delay_s": 120},
                ]
            }
        )
    )
    led = out / "ledger"
    log1 = launch_until(
        launch_args(
            out, shards=shards, faults=plan, timeout=150, flags=["--no-spares"], worker_args=["--set", *TRAIN_ARGS]
        ),
        lambda: any(r["step"] == PAST_CKPT for r in records(led, [0, 0])),
        150,
    )
    assert '"fault": "kill", "group": 1' in log1, log1[-4000:]
    late = [r["step"] for r in records(led, [1, 0]) if r["step"] > KILL_AT]
    assert not late, f"group 1 came back in attempt 1 (it recorded steps {late})"
    assert checkpoint.list_steps(str(out / "replica_0" / "checkpoints"))[-1] == CKPT
    # what the resumed job owes group 1: the batches it missed before group 0's checkpoint
    missed = {(r["epoch"], r["row_group"]) for r in records(led) if r["step"] < CKPT and 1 not in r["contributors"]}
    assert missed and all(e == 0 for e, _ in missed), f"group 1 missed {missed}: no make-up work was owed"

    # ---- attempt 2: the whole job relaunched from its checkpoints, to the end --------------
    r = run_launch(out, 180, shards=shards, timeout=150, worker_args=["--set", *TRAIN_ARGS, "train.resume=true"])
    assert r.returncode == 0, r.stdout[-5000:]
    assert f"step-{CKPT:08d} (step {CKPT}," in r.stdout, "group 0 did not resume from its checkpoint"
    # the job's count covers both attempts; the steps attempt 1 committed past the checkpoint, redone
    tl = json.loads((out / "timeline.json").read_text())["summary"]
    assert tl["committed_steps"] == json.loads((out / "replica_0" / "result.json").read_text())["steps"], tl
    assert tl["launch_committed_steps"] == tl["committed_steps"] - CKPT and tl["redone_steps"] > 0, tl

    sample_ids = shard_sample_ids(shards)

    # every sample of both epochs once, over both attempts
    summary = ledger.check(
        str(led), steps_per_epoch=steps, num_groups=2, ranks_per_group=1, epochs=2, sample_ids=sample_ids
    )
    assert summary["batches"] == 2 * 2 * steps
    made_up = {  # group 1's missed batches, made up by whichever group had a piece of them
        (e, rg)
        for r in records(led)
        if r["kind"] == "makeup" and r["step"] >= CKPT
        for h, owner, e, rg in r["pieces"]
        if owner == 1 and h in r["contributors"]
    }
    assert missed <= made_up, f"attempt 2 made up {sorted(made_up)}, group 1 missed {sorted(missed)} in attempt 1"
    # the groups met at one state: group 1 healed from group 0 (schedule included) and stayed with it
    s0 = (out / "replica_0" / "state.safetensors").read_bytes()
    s1 = (out / "replica_1" / "state.safetensors").read_bytes()
    assert s0 == s1, "the groups ended with different states"


def _ledger_lines(folder: Path, lines: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "group-000-rank-000.jsonl", "a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


def _rec(step: int, rg: int, contributors: list[int]) -> dict:
    return {
        "step": step,
        "epoch": 0,
        "row_group": rg,
        "kind": "regular",
        "contributors": contributors,
        "quorum_id": 1,
        "writer": [0, 0],
        "ranges": None,
    }


def test_resumed_to_drops_the_writers_later_records_only(tmp_path):
    """Records at or after the marker's step are gone; earlier ones stay current; a heal
    after it still supersedes (not drops) what came before."""
    led = tmp_path / "ledger"
    _ledger_lines(
        led, [_rec(0, 0, [0]), _rec(1, 1, [0]), _rec(2, 2, [0]), {"resumed_to": 1, "writer": [0, 0]}, _rec(1, 5, [0])]
    )
    assert [(r["step"], r["row_group"], sup) for r, sup in ledger.read(str(led))] == [(0, 0, False), (1, 5, False)]
    _ledger_lines(led, [{"healed_to": 2, "writer": [0, 0]}, _rec(2, 6, [0])])
    assert [(r["step"], sup) for r, sup in ledger.read(str(led))] == [(0, True), (1, True), (2, False)]


def test_schedule_survives_json_and_keeps_this_runs_epochs():
    """What a checkpoint's meta.json carries is enough to rebuild the make-up work owed."""
    sc = MakeupSchedule(4, 2, 2)
    for _ in range(3):
        sc.commit(sc.position({0}), {0})
    restored = MakeupSchedule(4, 2, 2)
    restored.load_state_dict(json.loads(json.dumps(sc.state_dict())))
    assert restored.makeup == [[0, 0, [1]], [0, 1, [1]], [0, 2, [1]]] and restored.index == 3
    with pytest.raises(ValueError, match="2 groups"):
        MakeupSchedule(4, 3, 2).load_state_dict(sc.state_dict())
