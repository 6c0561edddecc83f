"""The lighthouse status page inside the Airflow UI: a FastAPI app the plugin mounts on
the API server at /ftrec, shown as a "Lighthouse" tab of each DAG run (an external view)
and as a menu entry for a standing lighthouse (FTREC_LIGHTHOUSE_URL).

    GET /ftrec/lighthouse/?dag_id=D&run_id=R   HTML: groups, quorum, recent events
    GET /ftrec/lighthouse/status?dag_id=D&run_id=R   the same as JSON

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
from typing import Any

from fastapi import Depends, FastAPI, Query
from fastapi.responses import HTMLResponse

from ftrec_airflow import lighthouse, settings

try:   # Airflow's own authentication and DAG-access checks (the API server's auth manager)
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag
    can_read_runs = requires_access_dag("GET", DagAccessEntity.RUN)
except ImportError:   # no Airflow API server here: nobody may read the page
    def can_read_runs() -> None:
        from fastapi import HTTPException
        raise HTTPException(status_code=401, detail="the lighthouse page needs Airflow's API server")

app = FastAPI(title="ftrec lighthouse", docs_url=None, redoc_url=None, openapi_url=None,
              dependencies=[Depends(can_read_runs)])


def _loopback(url: str) -> bool:
    from urllib.parse import urlparse
    host = urlparse(url if "//" in url else f"http://{url}").hostname or ""
    return host == "localhost" or host.startswith("127.") or host == "::1"


def lookup(dag_id: str | None, run_id: str | None) -> dict[str, Any]:
    """{"source", "url", "live", "status", "fetched_at", "error"} for a DAG run's
    lighthouse, or for the standing one when no run is given."""
    snap = None
    token_file = job = None
    url = standing = settings.lighthouse_url()
    source = "FTREC_LIGHTHOUSE_URL" if url else "none"
    refused = ""
    if dag_id and run_id:
        run = settings.run_folder(dag_id, run_id)
        snap = lighthouse.read_snapshot(run)
        if snap:
            recorded = snap.get("url") if isinstance(snap.get("url"), str) else ""
            job = snap.get("job") if isinstance(snap.get("job"), str) else None
            source = f"run {dag_id} / {run_id}"
            if recorded and recorded == standing:
                url = standing                       # this server's token, from its environment
            elif recorded and _loopback(recorded):
                url, token_file = recorded, run / "train" / "token"   # the run's own launcher
            else:
                url = ""
                if recorded:
                    refused = (f"the run recorded lighthouse {recorded}, which is neither FTREC_LIGHTHOUSE_URL "
                               "nor on loopback: showing its last snapshot")
    doc = {"source": source, "url": url, "live": False, "status": None, "fetched_at": None, "error": refused}
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


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _age(seconds: Any) -> str:
    return f"{_num(seconds):.1f} s ago" if seconds is not None else ""


def _group_row(g: dict[str, Any]) -> str:
    """One group's row; every value escaped (a status comes from another process)."""
    def td(v: Any) -> str:
        return f"<td>{html.escape(str(v))}</td>"
    ok = g.get("healthy") is True
    ranks = f"{g.get('ranks')}/{g.get('world')}"
    return (f"<tr>{td(g.get('group'))}{td(g.get('incarnation'))}"
            f"<td class={'ok' if ok else 'bad'}>{'healthy' if ok else 'failed'}</td>"
            f"{td(g.get('step'))}{td(ranks)}{td(_age(g.get('last_beat_age_s')))}</tr>")


def render(doc: dict[str, Any]) -> str:
    e = html.escape
    st = doc.get("status") or {}
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["fetched_at"])) if doc.get("fetched_at") else "-"
    state = "live" if doc["live"] else f"snapshot of {when}" if st else "no status"
    q = st.get("quorum") or {}
    groups = "".join(_group_row(g) for g in st.get("groups", []) if isinstance(g, dict))
    events = "".join(
        f"<tr><td>{time.strftime('%H:%M:%S', time.localtime(_num(ev.get('t'))))}</td><td>{e(str(ev.get('kind', '')))}</td>"
        f"<td><code>{e(json.dumps({k: v for k, v in ev.items() if k not in ('t', 'kind')}))}</code></td></tr>"
        for ev in reversed(st.get("events", [])[-50:]) if isinstance(ev, dict))
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
