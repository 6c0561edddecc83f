"""A finished job tells its story: after a real chaos run (the toy trainer under the launcher,
one group SIGKILLed mid-run, restarted and healed), the Airflow lighthouse tab says
"finished", shows each group's committed steps, restarts and heals from the run's
timeline.json, and draws committed steps per group over time with the fault and the heal
marked; the same chart is a PNG for MLflow (training/timeline.py)."""

import json
from pathlib import Path

import pytest
from conftest import TOY, run_launch

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.integ]


@pytest.fixture(scope="module")
def chaos_timeline(tmp_path_factory):
    d = tmp_path_factory.mktemp("chaos")
    plan = d / "plan.json"
    plan.write_text(json.dumps({"faults": [{"kind": "kill", "group": 1, "at_step": 15}]}))
    r = run_launch(
        d / "train", 200, worker=TOY, faults=plan, timeout=150, worker_args=["--steps", "40", "--step-sleep", "0.02"]
    )
    assert r.returncode == 0, r.stdout[-3000:]
    from training import timeline_summary

    raw = (d / "train" / "timeline.json").read_bytes()  # and beside it the summary the Lighthouse tab reads
    written = json.loads((d / "train" / timeline_summary.FILE).read_text())
    assert written["timeline"] == timeline_summary.stamp(raw) and written["summary"]["groups_total"] == 2
    return json.loads(raw)


def test_series_and_story_follow_the_timeline(chaos_timeline, tmp_path):
    from training import timeline

    s = timeline.series(chaos_timeline)
    assert sorted(s["groups"]) == [0, 1]
    for pts in s["groups"].values():
        assert [p[1] for p in pts] == sorted(p[1] for p in pts) and pts[0][0] >= 0
    kinds = {m[2] for m in s["marks"]}
    assert {"fault", "heal_finished"} <= kinds, kinds
    story = {r["group"]: r for r in timeline.story(chaos_timeline)}
    assert story[1]["restarts"] == 1 and story[1]["heals"] == 1 and story[1]["failures"] == 1
    assert story[0]["restarts"] == 0 and story[0]["failures"] == 0
    assert story[0]["last_step"] == story[1]["last_step"] > 0 and story[0]["checksum"] == story[1]["checksum"]
    assert timeline.png(chaos_timeline, str(tmp_path / "t.png")) and (tmp_path / "t.png").stat().st_size > 1000
    assert timeline.svg({"steps": []}) == "" and not timeline.png({}, str(tmp_path / "none.png"))


def test_the_lighthouse_tab_of_a_finished_run_tells_what_happened(chaos_timeline, tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from ftrec_airflow import lighthouse_app, lighthouse_status, settings

    monkeypatch.setenv("FTREC_WORK", str(tmp_path / "work"))
    monkeypatch.delenv("FTREC_LIGHTHOUSE_URL", raising=False)
    run = settings.run_folder("ftrec_chaos_drill", "manual__1")
    (run / "train").mkdir(parents=True)
    # the last snapshot the train task kept: its lighthouse has ended with the job
    lighthouse_status.write_snapshot(
        run, "http://127.0.0.1:9", {"groups": [{"group": 0, "healthy": False}], "events": []}
    )
    tl = dict(chaos_timeline)
    newest = max(e["t"] for e in [*tl["launcher_events"], *tl["lighthouse_events"]])
    tl["lighthouse_events"] = [
        *tl["lighthouse_events"],
        {"t": tl["steps"][-1]["t"], "kind": "fault", "group": 0, "note": "<script>alert(1)</script>"},
        {"t": newest + 1, "kind": "checkpoint", "path": "/srv/work/runs/abc/train/replica_1/step-40"},
    ]
    (run / "train" / "timeline.json").write_text(json.dumps(tl))
    lighthouse_app.app.dependency_overrides[lighthouse_app.can_read_runs] = lambda: None
    try:
        client = TestClient(lighthouse_app.app)
        q = {"dag_id": "ftrec_chaos_drill", "run_id": "manual__1"}
        doc = client.get("/lighthouse/status", params=q).json()
        assert doc["error"] == "" and doc["timeline"]["exit_code"] == 0
        page = client.get("/lighthouse/", params=q).text
    finally:
        lighthouse_app.app.dependency_overrides.clear()
    assert "<b>finished</b>" in page and "does not answer" not in page and ">failed<" not in page
    assert "all groups ended with the same state" in page
    assert page.count("class=group-row") == 2 and page.count("<polyline class='group'") == 2
    assert "data-kind='fault'" in page and "data-kind='heal_finished'" in page
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;" in page
    # what a user reads: no dead address shown as a place, axis titles, events as words, not JSON
    assert "its lighthouse ended with the job" in page and "127.0.0.1:9" not in page
    assert "committed step</span>" in page and "seconds since the launch" in page
    assert "path …/replica_1/step-40" in page and "/srv/work/runs" not in page
    assert "No faults" not in page


def test_a_job_without_faults_says_so_instead_of_an_empty_legend(chaos_timeline):
    from ftrec_airflow import lighthouse_app
    from training import timeline

    quiet = {k: v for k, v in chaos_timeline.items() if k not in ("launcher_events", "lighthouse_events")}
    assert timeline.series(quiet)["marks"] == [] and timeline.svg(quiet)
    assert "No faults, failures or heals in this job" in lighthouse_app._chart(timeline.summary(quiet))
