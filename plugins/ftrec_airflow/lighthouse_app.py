"""The lighthouse status page inside the Airflow UI: a FastAPI app the plugin mounts on
the API server at /ftrec, shown as a "Lighthouse" tab of each DAG run (an external view)
and as a menu entry for a standing lighthouse (FTREC_LIGHTHOUSE_URL).

    GET /ftrec/lighthouse/?dag_id=D&run_id=R   HTML: groups, quorum, recent events
    GET /ftrec/lighthouse/status?dag_id=D&run_id=R   the same as JSON

The page only ever contacts lighthouses it already knows (FTREC_LIGHTHOUSE_URL or the
address a train task recorded in its run folder), never a URL taken from the request.
"""

import html
import json
import time
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse

from ftrec_airflow import lighthouse, settings

app = FastAPI(title="ftrec lighthouse", docs_url=None, redoc_url=None, openapi_url=None)


def lookup(dag_id: str | None, run_id: str | None) -> dict[str, Any]:
    """{"source", "url", "live", "status", "fetched_at", "error"} for a DAG run's
    lighthouse, or for the standing one when no run is given."""
    snap = None
    token_file = job = None
    url = settings.lighthouse_url()
    source = "FTREC_LIGHTHOUSE_URL" if url else "none"
    if dag_id and run_id:
        snap = lighthouse.read_snapshot(settings.run_folder(dag_id, run_id))
        if snap:
            url, source = snap.get("url") or url, f"run {dag_id} / {run_id}"
            token_file = snap.get("token_file")
            job = snap.get("job")
    doc = {"source": source, "url": url, "live": False, "status": None, "fetched_at": None, "error": ""}
    if url:
        try:
            doc.update(status=lighthouse.fetch_status(url, timeout=1.0, token_file=token_file, job=job), live=True, fetched_at=time.time())
            return doc
        except (OSError, ValueError) as e:
            doc["error"] = f"lighthouse at {url} does not answer ({e})"
    if snap:
        doc.update(status=snap.get("status"), fetched_at=snap.get("fetched_at"))
    elif not doc["error"]:
        doc["error"] = ("no lighthouse recorded for this DAG run" if dag_id else
                        "no standing lighthouse configured (set FTREC_LIGHTHOUSE_URL)")
    return doc


def _age(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.1f} s ago"


def render(doc: dict[str, Any]) -> str:
    e = html.escape
    st = doc.get("status") or {}
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["fetched_at"])) if doc.get("fetched_at") else "-"
    state = "live" if doc["live"] else f"snapshot of {when}" if st else "no status"
    q = st.get("quorum") or {}
    groups = "".join(
        f"<tr><td>{g.get('group')}</td><td>{g.get('incarnation')}</td>"
        f"<td class={'ok' if g.get('healthy') else 'bad'}>{'healthy' if g.get('healthy') else 'failed'}</td>"
        f"<td>{g.get('step')}</td><td>{g.get('ranks')}/{g.get('world')}</td>"
        f"<td>{_age(g.get('last_beat_age_s'))}</td></tr>"
        for g in st.get("groups", []))
    events = "".join(
        f"<tr><td>{time.strftime('%H:%M:%S', time.localtime(ev.get('t', 0)))}</td><td>{e(str(ev.get('kind', '')))}</td>"
        f"<td><code>{e(json.dumps({k: v for k, v in ev.items() if k not in ('t', 'kind')}))}</code></td></tr>"
        for ev in reversed(st.get("events", [])[-50:]))
    refresh = "<meta http-equiv='refresh' content='3'>" if doc["live"] else ""
    return f"""<!doctype html><html><head><meta charset='utf-8'>{refresh}<title>ftcore lighthouse</title>
<style>body{{font-family:system-ui,sans-serif;margin:1rem}}table{{border-collapse:collapse;margin:.5rem 0}}
td,th{{border:1px solid #ccc;padding:.2rem .5rem;text-align:left}}.ok{{color:#070}}.bad{{color:#b00}}
.muted{{color:#666}}</style></head><body>
<h2>ftcore lighthouse</h2>
<p class=muted>{e(doc['source'])} &middot; {e(doc['url'] or 'no address')} &middot; {e(state)}</p>
{f"<p class=bad>{e(doc['error'])}</p>" if doc['error'] else ''}
<p>quorum <b>{e(str(q.get('quorum_id', '-')))}</b>, participants {e(str(q.get('groups', q.get('participants', '-'))))},
max committed step <b>{e(str(st.get('max_step', '-')))}</b>, min replicas {e(str(st.get('min_replicas', '-')))}</p>
<table><tr><th>group</th><th>incarnation</th><th>state</th><th>step</th><th>ranks</th><th>last heartbeat</th></tr>{groups}</table>
<h3>recent events</h3><table><tr><th>time</th><th>event</th><th>detail</th></tr>{events}</table>
</body></html>"""


@app.get("/lighthouse/status")
def status(dag_id: str | None = Query(None), run_id: str | None = Query(None)) -> dict[str, Any]:
    return lookup(dag_id, run_id)


@app.get("/lighthouse/", response_class=HTMLResponse)
def page(dag_id: str | None = Query(None), run_id: str | None = Query(None)) -> str:
    return render(lookup(dag_id, run_id))
