"""The Airflow UI and the MLflow UI in a real browser (headless Chromium, driven by
Playwright), after a real DAG run with a fault, on the production tier (tests/test_airflow_integration.py:
PostgreSQL, Airflow's four components, an MLflow tracking server on its own database), all on
loopback.

ftrec_train runs 2 replica groups and SIGKILLs group 1 at step 4 (the launcher restarts it). Then,
logged in: the DAG run's "Lighthouse" tab (the plugin's external view, an iframe inside
Airflow's React UI) shows the finished job, both groups, group 1's restart, the chart with
the fault and the failure marked, and fits its frame in the grid and in the graph view; a task's
Logs tab shows its log; the MLflow run the train task links to renders in the MLflow UI with its
metrics; an anonymous browser is refused. Screenshots of the tab are kept beside the logs.

Skips with the reason when Chromium or Playwright is not installed (`.ci/run` installs
Debian's chromium; Playwright uses it, it downloads no browser of its own).
"""

import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest
from test_airflow_integration import _call, _token, _wait, production_tier  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.integ]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CONF = {
    "data_source": "synthetic",
    "synth_users": 240,
    "synth_items": 120,
    "max_steps": 12,
    "batch_size": 16,
    "max_len": 20,
    "replica_groups": 2,
    "fault_plan": json.dumps({"faults": [{"kind": "kill", "group": 1, "at_step": 4}]}),
    "train_overrides": ["model.dim=16", "eval.batch_size=256", "mlflow.system_metrics=false"],
}


def _needs_a_browser():
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")


@pytest.fixture
def browser():
    """Skips before the tier starts when there is no browser to drive."""
    _needs_a_browser()


def _fits(page, view: str) -> None:
    """The Lighthouse tab's content fits its frame: wide tables scroll inside themselves, the
    page never needs a sideways scroll that cuts columns off."""
    frame = page.frame_locator("iframe").first
    frame.locator("text=finished").first.wait_for(timeout=60_000)
    width = page.locator("iframe").first.bounding_box()["width"]
    over = frame.locator("html").evaluate("e => e.scrollWidth - e.clientWidth")
    assert over <= 1, f"{view}: the tab is {over}px wider than its {width:.0f}px frame"


def test_lighthouse_tab_and_mlflow_run_in_a_real_browser(browser, production_tier):  # noqa: F811 - the fixture
    from playwright.sync_api import sync_playwright

    tier, mlflow = production_tier
    base, home, procs, tmp, mlflow_ui = tier.base, tier.home, tier.procs, tier.tmp, mlflow.url
    _wait("the API server", lambda: _call(base, "/api/v2/monitor/health"), 180, procs)
    token = _wait("a login token", lambda: _token(base, home), 60, procs)
    _wait("ftrec_train to be parsed", lambda: _call(base, "/api/v2/dags/ftrec_train", token), 180, procs)
    _call(base, "/api/v2/dags/ftrec_train", token, body={"is_paused": False}, method="PATCH")
    run_id = _call(base, "/api/v2/dags/ftrec_train/dagRuns", token, body={"logical_date": None, "conf": CONF})[
        "dag_run_id"
    ]
    q = urllib.request.quote(run_id)

    def finished():
        state = _call(base, f"/api/v2/dags/ftrec_train/dagRuns/{q}", token)["state"]
        return state if state in ("success", "failed") else None

    assert _wait("the DAG run to finish", finished, 420, procs) == "success", f"logs in {tmp}"
    links = _call(base, f"/api/v2/dags/ftrec_train/dagRuns/{q}/taskInstances/train/links", token)["extra_links"]
    assert links["MLflow run"].startswith(mlflow_ui)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], timeout=60_000)
        try:
            # anonymous: Airflow's login guards the plugin's page
            anon = browser.new_page()
            resp = anon.goto(f"{base}/ftrec/lighthouse/?dag_id=ftrec_train&run_id={q}")
            assert resp.status in (401, 403) and "committed steps" not in anon.content()

            ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
            ctx.add_cookies([{"name": "_token", "value": token, "url": base}])
            page = ctx.new_page()
            page.goto(f"{base}/dags/ftrec_train/runs/{q}/plugin/ftrec-lighthouse-run", wait_until="networkidle")
            tab = page.frame_locator("iframe").first
            tab.locator("text=finished").first.wait_for(timeout=60_000)
            assert tab.locator("tr.group-row").count() == 2
            assert tab.locator("svg.ftrec-timeline polyline.group").count() == 2
            marks = {
                tab.locator("svg.ftrec-timeline line.mark").nth(i).get_attribute("data-kind")
                for i in range(tab.locator("svg.ftrec-timeline line.mark").count())
            }
            assert {"fault", "group_failed"} <= marks, marks  # (the job may end before group 1 is back)
            restarts = tab.locator("tr.group-row").nth(1).locator("td").nth(2).inner_text()
            assert restarts == "1", restarts
            assert "does not answer" not in tab.locator("body").inner_text()
            assert "its lighthouse ended with the job" in tab.locator("body").inner_text()  # no dead address
            assert "seconds since the launch" in tab.locator("body").inner_text()  # the chart's axis title
            _fits(page, "grid view")
            page.screenshot(path=str(tmp / "lighthouse-tab.png"), full_page=True)
            page.locator("body").press("g")  # Airflow's shortcut: the graph view beside the tab
            page.wait_for_timeout(1500)
            _fits(page, "graph view")
            page.screenshot(path=str(tmp / "lighthouse-tab-graph.png"), full_page=True)

            # Browse -> "ftcore lighthouse" with no standing lighthouse: said plainly, not as an error
            browse = ctx.new_page()
            browse.goto(f"{base}/plugin/ftrec-lighthouse", wait_until="networkidle")
            nav = browse.frame_locator("iframe").first
            nav.locator("text=No standing lighthouse is configured").first.wait_for(timeout=60_000)
            assert nav.locator(".bad").count() == 0

            # a task's Logs tab shows its log, not "Log file not found on worker"
            log_page = ctx.new_page()
            log_page.goto(f"{base}/dags/ftrec_train/runs/{q}/tasks/register_model", wait_until="networkidle")
            log_page.locator("text=gate verdict").first.wait_for(timeout=60_000)
            assert "Log file not found" not in log_page.locator("body").inner_text()
            if os.environ.get("FTREC_KEEP_SCREENSHOTS"):
                shutil.copy(tmp / "lighthouse-tab.png", "/tmp/lighthouse-tab.png")

            # the MLflow run the train task links to, in the MLflow UI (a React app: rendered by the browser)
            mlflow_page = ctx.new_page()
            mlflow_page.goto(links["MLflow run"], wait_until="domcontentloaded")  # its UI polls: never idle
            mlflow_page.locator(f"text=ftrec_train {run_id}").first.wait_for(timeout=60_000)
            mlflow_page.screenshot(path=str(tmp / "mlflow-run.png"))
        finally:
            browser.close()
    assert (tmp / "lighthouse-tab.png").stat().st_size > 10_000
