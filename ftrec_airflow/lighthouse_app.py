"""The lighthouse status page inside the Airflow UI: a FastAPI app the plugin mounts on
the API server at /ftrec, shown as a "Lighthouse" tab of each DAG run (an external view)
and as a menu entry for a standing lighthouse (FTREC_LIGHTHOUSE_URL).

    GET /ftrec/lighthouse/?dag_id=D&run_id=R   HTML: groups, quorum, recent events
    GET /ftrec/lighthouse/status?dag_id=D&run_id=R   the same as JSON

While the job runs the page shows the lighthouse live (groups, steps, quorum, heals). Once
the launcher has written the run's timeline (`<run folder>/train/timeline.json`, the
pipeline's fixed place) it tells what happened: finished or not, each group's committed
steps, restarts, heals and exclusions, and a chart of committed steps per group over time
with faults, failures and heals marked (training/timeline.py, the chart the launcher also
logs to the MLflow run). A lighthouse that ended with its job is not an error then.

Every route needs an Airflow login with read access to the DAG's runs (the auth manager's
own checks: 401 without a login, 403 without access). The page contacts only the standing
lighthouse (FTREC_LIGHTHOUSE_URL, with this server's FTCORE_TOKEN/FTCORE_TOKEN_FILE) or a
run's own launcher lighthouse on loopback (with that run's token, at the pipeline's fixed
place `<run folder>/train/token`): never a URL or a file path read from a run folder's
files, which anyone who can write there could plant. Every value shown is escaped.
"""

import html
import json
import time
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, Query
from fastapi.responses import HTMLResponse

from ftrec_airflow import lighthouse, settings


def _no_api_server() -> None:
    from fastapi import HTTPException

    raise HTTPException(status_code=401, detail="the lighthouse page needs Airflow's API server")


can_read_runs: Callable[..., None] = _no_api_server  # no Airflow API server here: nobody may read the page
try:  # Airflow's own authentication and DAG-access checks (the API server's auth manager)
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag

    can_read_runs = requires_access_dag("GET", DagAccessEntity.RUN)
except ImportError:
    pass

app = FastAPI(
    title="ftrec lighthouse", docs_url=None, redoc_url=None, openapi_url=None, dependencies=[Depends(can_read_runs)]
)


def _loopback(url: str) -> bool:
    from urllib.parse import urlparse

    host = urlparse(url if "//" in url else f"http://{url}").hostname or ""
    return host == "localhost" or host.startswith("127.") or host == "::1"


def _timeline(run: Any) -> dict[str, Any] | None:
    try:
        tl = json.loads((run / "train" / "timeline.json").read_text())
        return tl if isinstance(tl, dict) else None
    except (OSError, ValueError):
        return None


def lookup(dag_id: str | None, run_id: str | None) -> dict[str, Any]:
    """{"source", "url", "live", "status", "fetched_at", "error", "timeline"} for a DAG run's
    lighthouse, or for the standing one when no run is given."""
    snap = timeline = None
    token_file = job = None
    url = standing = settings.lighthouse_url()
    source = "FTREC_LIGHTHOUSE_URL" if url else "none"
    refused = ""
    if dag_id and run_id:
        run = settings.run_folder(dag_id, run_id)
        snap, timeline = lighthouse.read_snapshot(run), _timeline(run)
        if snap:
            recorded = snap.get("url") if isinstance(snap.get("url"), str) else ""
            job = snap.get("job") if isinstance(snap.get("job"), str) else None
            source = f"run {dag_id} / {run_id}"
            if recorded and recorded == standing:
                url = standing  # this server's token, from its environment
            elif recorded and _loopback(recorded):
                url, token_file = recorded, run / "train" / "token"  # the run's own launcher
            else:
                url = ""
                if recorded:
                    refused = (
                        f"the run recorded lighthouse {recorded}, which is neither FTREC_LIGHTHOUSE_URL "
                        "nor on loopback: showing its last snapshot"
                    )
    doc = {
        "source": source,
        "url": url,
        "live": False,
        "status": None,
        "fetched_at": None,
        "error": refused,
        "timeline": timeline,
    }
    if url and timeline is None:  # a finished job's lighthouse has ended with it: do not ask
        try:
            status = lighthouse.fetch_status(url, timeout=1.0, token_file=token_file, job=job)
            doc.update(status=status, live=True, fetched_at=time.time())
            return doc
        except (OSError, ValueError) as e:
            doc["error"] = f"lighthouse at {url} does not answer ({e})"
    if snap:
        doc.update(status=snap.get("status"), fetched_at=snap.get("fetched_at"))
    elif not doc["error"] and timeline is None:
        doc["error"] = (
            "no lighthouse recorded for this DAG run"
            if dag_id
            else "no standing lighthouse configured (set FTREC_LIGHTHOUSE_URL)"
        )
    return doc


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _age(seconds: Any) -> str:
    return f"{_num(seconds):.1f} s ago" if seconds is not None else ""


def _td(v: Any) -> str:
    return f"<td>{html.escape(str(v))}</td>"


def _group_row(g: dict[str, Any]) -> str:
    """One group's row; every value escaped (a status comes from another process)."""
    ok = g.get("healthy") is True
    state = (
        ("standby (slow)", "warn")
        if g.get("standby_s")
        else ("left", "muted")
        if g.get("left")
        else ("healthy", "ok")
        if ok
        else ("failed", "bad")
    )
    ranks = f"{g.get('ranks')}/{g.get('world')}"
    return (
        f"<tr>{_td(g.get('group'))}{_td(g.get('incarnation'))}"
        f"<td class={state[1]}>{state[0]}</td>"
        f"{_td(g.get('step'))}{_td(ranks)}{_td(_age(g.get('last_beat_age_s')))}</tr>"
    )


def _finished(tl: dict[str, Any]) -> str:
    """A finished job's story: outcome, one row per group, the chart."""
    from training import timeline

    code, story = tl.get("exit_code"), timeline.story(tl)
    sums = {r["checksum"] for r in story if r["checksum"]}
    outcome = (
        "<p class=ok><b>finished</b>"
        if code == 0
        else f"<p class=bad><b>ended with exit code {html.escape(str(code))}</b>"
    )
    outcome += (
        " &middot; all groups ended with the same state</p>"
        if len(sums) == 1
        else " &middot; <span class=bad>groups ended with different states</span></p>"
        if len(sums) > 1
        else "</p>"
    )
    rows = "".join(
        f"<tr class=group-row>{_td(r['group'])}{_td(r['last_step'])}{_td(r['restarts'])}{_td(r['failures'])}"
        f"{_td(r['heals'])}{_td(r['exclusions'])}"
        f"<td><code>{html.escape(str(r['checksum'] or r['note']))}</code></td></tr>"
        for r in story
    )
    return (
        f"{outcome}<table><tr><th>group</th><th>committed steps</th><th>restarts</th><th>failures</th>"
        f"<th>heals</th><th>slow exclusions</th><th>final state</th></tr>{rows}</table>"
        f"<h3>committed steps per group</h3>{timeline.svg(tl)}"
    )


def render(doc: dict[str, Any]) -> str:
    e = html.escape
    st = doc.get("status") or {}
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["fetched_at"])) if doc.get("fetched_at") else "-"
    tl = doc.get("timeline")
    state = "live" if doc["live"] else "finished job" if tl else f"snapshot of {when}" if st else "no status"
    q = st.get("quorum") or {}
    groups = "".join(_group_row(g) for g in st.get("groups", []) if isinstance(g, dict))
    evs = (
        st.get("events", [])
        if not tl
        else sorted(
            (ev for ev in [*tl.get("launcher_events", []), *tl.get("lighthouse_events", [])] if isinstance(ev, dict)),
            key=lambda ev: _num(ev.get("t")),
        )
    )
    events = "".join(
        f"<tr><td>{time.strftime('%H:%M:%S', time.localtime(_num(ev.get('t'))))}</td>"
        f"<td>{e(str(ev.get('kind', '')))}</td>"
        f"<td><code>{e(json.dumps({k: v for k, v in ev.items() if k not in ('t', 'kind')}))}</code></td></tr>"
        for ev in reversed(evs[-50:])
        if isinstance(ev, dict)
    )
    refresh = "<meta http-equiv='refresh' content='3'>" if doc["live"] else ""
    quorum, participants = q.get("quorum_id", "-"), q.get("groups", q.get("participants", "-"))
    heads = "".join(f"<th>{h}</th>" for h in ("group", "incarnation", "state", "step", "ranks", "last heartbeat"))
    body = (
        _finished(tl)
        if tl
        else f"""<p>quorum <b>{e(str(quorum))}</b>, participants {e(str(participants))},
max committed step <b>{e(str(st.get("max_step", "-")))}</b>, min replicas {e(str(st.get("min_replicas", "-")))}</p>
<table><tr>{heads}</tr>{groups}</table>"""
    )
    return f"""<!doctype html><html><head><meta charset='utf-8'>{refresh}<title>ftcore lighthouse</title>
<style>body{{font-family:system-ui,sans-serif;margin:1rem}}table{{border-collapse:collapse;margin:.5rem 0}}
td,th{{border:1px solid #ccc;padding:.2rem .5rem;text-align:left}}.ok{{color:#070}}.bad{{color:#b00}}
.muted{{color:#666}}.warn{{color:#a0a}}</style></head><body>
<h2>ftcore lighthouse</h2>
<p class=muted>{e(doc["source"])} &middot; {e(doc["url"] or "no address")} &middot; {e(state)}</p>
{f"<p class=bad>{e(doc['error'])}</p>" if doc["error"] else ""}
{body}
<h3>recent events</h3><table><tr><th>time</th><th>event</th><th>detail</th></tr>{events}</table>
</body></html>"""


@app.get("/lighthouse/status")
def status(dag_id: str | None = Query(None), run_id: str | None = Query(None)) -> dict[str, Any]:
    return lookup(dag_id, run_id)


@app.get("/lighthouse/", response_class=HTMLResponse)
def page(dag_id: str | None = Query(None), run_id: str | None = Query(None)) -> str:
    return render(lookup(dag_id, run_id))
