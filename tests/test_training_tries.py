"""Counts and metrics that tell the truth across the tries of one job: a resumed run logs each
step once, MLflow's system metrics start again after a tracking outage, and the launcher's
committed-step count is the job's, not only its last launch's. Real MLflow stores (SQLite)."""

import os
import time

from training import tracking
from training.config import MlflowConfig
from training.launch import job_steps


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """Try 1 logs steps 1-5 and dies after its checkpoint at 3; try 2 continues the run from 3:
    steps 4 and 5 keep try 1's points, 6-8 are new, none twice."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = tracking.Tracker(MlflowConfig(tracking_uri=uri, system_metrics=False), str(tmp_path / "a"))
    for step in range(1, 6):
        first.log_metrics({"train/loss": 1.0 / step, "hr@10": 0.1}, step)
    assert first.close() == 0
    again = MlflowConfig(tracking_uri=uri, system_metrics=False, run_id=first.run_id or "")
    second = tracking.Tracker(again, str(tmp_path / "b"))
    for step in range(4, 9):
        second.log_metrics({"train/loss": 100.0 + step}, step)
    second.log_metrics({"hr@10": 0.2}, 8)
    assert second.close() == 0
    loss = _history(uri, first.run_id or "", "train/loss")
    assert loss == [(s, 1.0 / s) for s in range(1, 6)] + [(s, 100.0 + s) for s in range(6, 9)]
    assert _history(uri, first.run_id or "", "hr_at_10") == [(s, 0.1) for s in range(1, 6)] + [(8, 0.2)]


def test_system_metrics_start_again_after_a_tracking_outage(tmp_path, monkeypatch):
    """The store goes away for a while (its file moved), then comes back: MLflow's sampling
    thread ended at its first failure; the tracker starts another, whose points follow."""
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    monkeypatch.setattr(tracking, "MONITOR_CHECK_S", 0.3)
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    t = tracking.Tracker(MlflowConfig(tracking_uri=uri), str(tmp_path))
    t.log_metrics({"train/loss": 1.0}, 1)
    deadline = time.monotonic() + 60
    while t.run_id is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    os.rename(db, tmp_path / "away.db")  # the outage
    time.sleep(2.0)
    db.unlink(missing_ok=True)
    os.rename(tmp_path / "away.db", db)
    back = time.time()
    t.log_metrics({"train/loss": 0.5}, 2)
    time.sleep(3.0)
    assert t.close() == 0
    from mlflow import MlflowClient

    points = MlflowClient(uri).get_metric_history(t.run_id or "", "system/cpu_utilization_percentage")
    assert [p for p in points if p.timestamp / 1000 > back], f"no system metrics after the outage: {points}"
    assert _history(uri, t.run_id or "", "train/loss") == [(1, 1.0), (2, 0.5)]


def _rec(step: int, t: float, committed: bool = True) -> dict:
    return {"step": step, "t": t, "committed": committed, "group": 0}


def test_committed_steps_are_the_jobs_over_every_launch():
    """Launch 1 committed 1-12 (checkpoint at 8) and died; launch 2 resumed at 8 and went to 20."""
    earlier = [_rec(s, 100.0 + s) for s in range(1, 13)]
    steps = [_rec(s, 200.0 + s) for s in range(9, 21)] + [_rec(21, 230.0, committed=False)]
    assert job_steps(steps, earlier) == {"committed_steps": 20, "launch_committed_steps": 12, "redone_steps": 4}
    # a job's first launch: nothing redone, whatever an earlier job left in the folder
    fresh = [_rec(s, 300.0 + s) for s in range(1, 6)]
    assert job_steps(fresh, earlier) == {"committed_steps": 5, "launch_committed_steps": 5, "redone_steps": 0}
