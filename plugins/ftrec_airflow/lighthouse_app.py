"""The lighthouse status page inside the Airflow UI: a FastAPI app the plugin mounts on the API
server at /ftrec, shown as a "Lighthouse" tab of each DAG run (an external view) and as a menu
entry for a standing lighthouse (FTREC_LIGHTHOUSE_URL).

The long form: docs/airflow.md, "plugins/ftrec_airflow/lighthouse_app"."""

import html
import ipaddress
import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from fastapi import Depends, FastAPI, Query
from fastapi.responses import HTMLResponse

from ftrec_airflow import lighthouse_status, settings, timeline_cache

DEFAULT_JOB = "default"  # ftcore.messages.DEFAULT_JOB: the job the standing lighthouse's menu entry shows


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


def loopback_url(url: str) -> str | None:
    """`url` rebuilt as http://IP:PORT when its host is a numeric loopback address (an IP
    address, not a name: `127.attacker.example` is a name), else None."""
    from urllib.parse import urlparse

    try:
        p = urlparse(url if "//" in url else f"http://{url}")
        ip, port = ipaddress.ip_address(p.hostname or ""), p.port
    except ValueError:
        return None
    if p.scheme != "http" or not ip.is_loopback or not port or p.username or p.password or p.path not in ("", "/"):
        return None
    return f"http://{ip}:{port}" if ip.version == 4 else f"http://[{ip}]:{port}"


# a timeline larger than this is not read (the page summarizes it on the API server's machine)
TIMELINE_MAX_BYTES = int(float(os.environ.get("FTREC_TIMELINE_MAX_MB", "64")) * (1 << 20))
# a timeline up to this size without the writer's summary is parsed on the request: about
# 0.25 s of CPU holding the GIL (benchmarks/page_render.py); a larger one goes to the worker
INLINE_MAX_BYTES = 4 << 20
SUMMARY_MAX_BYTES = 1 << 20  # the writer's summary file (training.timeline_summary: well under this)
SUMMARIES = timeline_cache.Summaries(lambda fd: timeline_cache.in_child(fd, TIMELINE_MAX_BYTES))


def _too_large(size: int) -> str:
    return (
        f"this run's timeline.json is {size / (1 << 20):.3g} MiB, over the page's bound of "
        f"{TIMELINE_MAX_BYTES / (1 << 20):.3g} MiB (FTREC_TIMELINE_MAX_MB): not shown; "
        "read it from the run folder or the MLflow run's artifacts"
    )


def _timeline(run: Path) -> tuple[dict[str, Any] | None, str, bool]:
    """(summary, note, pending): the run's timeline.json summarized and bounded (training.
    timeline_summary), or None and why not; pending while the worker summarizes it. From the
    writer's summary when it matches the timeline, else parsed here when small, else the
    worker's (timeline_cache): no view parses a large timeline on the request."""
    path = run / "train" / "timeline.json"
    f = lighthouse_status.open_nofollow(path, settings.work_root())
    if f is None:
        return None, "", False
    with f:
        st = os.fstat(f.fileno())
        if st.st_size > TIMELINE_MAX_BYTES:
            return None, _too_large(st.st_size), False
        done = _written(run, st.st_size, f)
        k = timeline_cache.key(path, st)
        done = done or SUMMARIES.get(k)
        if done is not None:
            return done[0], done[1], False
        if st.st_size <= INLINE_MAX_BYTES:
            f.seek(0)
            done = _parsed(f.read(st.st_size + 1))
            SUMMARIES.put(k, done)
            return done[0], done[1], False
        if not SUMMARIES.submit(k, f.fileno()):
            return None, "the page is summarizing other runs' timelines: refresh in a minute", True
    return None, f"summarizing this run's timeline ({st.st_size / (1 << 20):.0f} MiB): refresh in a few seconds", True


def _written(run: Path, size: int, f: BinaryIO) -> timeline_cache.Result | None:
    """The writer's summary of the timeline open as `f` (training.timeline_summary.FILE);
    None when there is none or it summarizes another timeline (stale, or the timeline
    replaced); the refusal when it is not a summary (types and shapes checked, lists cut)."""
    from training import timeline_summary

    where = run / "train" / timeline_summary.FILE
    raw = lighthouse_status.read_nofollow(where, settings.work_root(), limit=SUMMARY_MAX_BYTES)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        stamp = timeline_summary.stamp_of(doc)
        if stamp["size"] != size or stamp != timeline_summary.stamp(f):
            return None
        return timeline_summary.bounded(doc.get("summary")), ""
    except (ValueError, RecursionError):
        return None, timeline_cache.UNREADABLE


def _parsed(raw: bytes) -> timeline_cache.Result:
    from training import timeline_summary

    try:
        return timeline_summary.summarize_json(raw), ""
    except ValueError:
        return None, timeline_cache.UNREADABLE


def _jobs(dag_id: str, run_id: str) -> list[str]:
    """The job ids this DAG run's training reports under: the train task's (ftrec_airflow.
    decorators) and the Kubernetes DAG's train_group's (ftrec_airflow.kubernetes)."""
    return [settings.lighthouse_job_id(f"{dag_id}/{run_id}/{task}") for task in ("train", "train_group")]


def _target(snap: dict | None, dag_id: str, run_id: str, standing: str) -> tuple[str, str | None, str]:
    """(url, job, note): whom to ask about this run. The URL is the standing lighthouse or a
    numeric loopback address; the job one of this run's own ids; never a value taken as is."""
    jobs = _jobs(dag_id, run_id)
    recorded = snap.get("url") if snap and isinstance(snap.get("url"), str) else ""
    job = snap.get("job") if snap and snap.get("job") in jobs else None
    if standing and (recorded == standing or (not recorded and job)):
        return standing, job or jobs[0], ""
    if recorded and loopback_url(recorded):
        return loopback_url(recorded) or "", None, ""
    if recorded:
        return "", None, "the run recorded a lighthouse that is neither FTREC_LIGHTHOUSE_URL nor a loopback address"
    return "", None, ""


def _fetched_at(snap: dict) -> tuple[float | None, str]:
    at = snap.get("fetched_at")
    if at is None or (isinstance(at, (int, float)) and not isinstance(at, bool) and 0 <= at < 1e11):
        return at, ""
    return None, "the snapshot's fetched_at is not a time (epoch seconds): its age is unknown"


def lookup(dag_id: str | None, run_id: str | None) -> dict[str, Any]:
    """{"source", "url", "live", "status", "fetched_at", "error", "note", "timeline", "pending"}
    for a DAG run's lighthouse, or for the standing one when no run is given. Asks only the standing
    lighthouse or a numeric loopback address, with this server's own token (server_token)."""
    standing = settings.lighthouse_url()
    snap = timeline = None
    source, url, job, note, refused = ("FTREC_LIGHTHOUSE_URL" if standing else "none"), standing, DEFAULT_JOB, "", ""
    pending = False
    if dag_id and run_id:
        run = settings.run_folder(dag_id, run_id)
        (timeline, refused, pending), snap = _timeline(run), lighthouse_status.read_snapshot(run)
        source = f"run {dag_id} / {run_id}"
        url, found, note = _target(snap, dag_id, run_id, standing) if snap else ("", None, "")
        job = found or _jobs(dag_id, run_id)[0]  # whose job the page shows (and whose token it sends)
    doc: dict[str, Any] = {
        "source": source,
        "url": url,
        "live": False,
        "status": None,
        "fetched_at": None,
        "error": "",
        "note": "; ".join(n for n in (note, refused) if n),
        "timeline": timeline,
        "pending": pending,
    }
    if url and timeline is None and not refused:  # a finished job's lighthouse has ended with it: do not ask
        try:
            status = _ask(url, job, bool(dag_id and run_id and url != standing))
            doc.update(status=_own(status, job), live=True, fetched_at=time.time())
            return doc
        except (OSError, ValueError) as e:
            doc["error"] = f"lighthouse at {url} does not answer ({e})"
    if snap:
        at, bad = _fetched_at(snap)
        last = snap.get("status")
        doc.update(status=_own(last, job) if isinstance(last, dict) else None, fetched_at=at)
        doc["note"] = "; ".join(n for n in (doc["note"], bad) if n)
    elif not doc["error"] and timeline is None and not refused:
        doc["note"] = (
            "no lighthouse recorded for this DAG run yet"
            if dag_id
            else "No standing lighthouse is configured (FTREC_LIGHTHOUSE_URL is not set). That is the default: "
            "each training starts its own lighthouse, shown in the Lighthouse tab of its DAG run."
        )
    return doc


def _ask(url: str, job: str, loopback: bool) -> dict[str, Any]:
    """The status of `job` from the lighthouse at `url`, asked with `job`'s token derived from
    this server's secret (ftcore.auth.job_token): never the secret itself, which would list
    every job. A run's own (loopback) lighthouse hosts one job, the launcher's default: it is
    asked for that one with that job's token."""
    secret = lighthouse_status.server_token()
    job = DEFAULT_JOB if loopback else job
    token = lighthouse_status.job_token(secret, job) if secret else ""
    return lighthouse_status.fetch_status(url, timeout=1.0, job=None if loopback else job, token=token)


def _own(status: dict[str, Any], job: str) -> dict[str, Any]:
    """`status` with its job list cut to `job`: the page shows one job, not the others'."""
    if isinstance(status.get("jobs"), list):
        return {**status, "jobs": [j for j in status["jobs"] if j == job]}
    return status


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


def _more(shown: int, total: int, what: str) -> str:
    return f"<p class=note>{total - shown} more {what} not shown ({shown} of {total})</p>" if total > shown else ""


def _finished(tl: dict[str, Any]) -> str:
    """A finished job's story from its summary (training.timeline.summary): outcome, one row
    per group shown, the chart."""
    code, story, states = tl.get("exit_code"), tl["groups"], tl["states"]
    outcome = (
        "<p class=ok><b>finished</b>"
        if code == 0
        else f"<p class=bad><b>ended with exit code {html.escape(str(code))}</b>"
    )
    outcome += (
        " &middot; all groups ended with the same state</p>"
        if states == 1
        else " &middot; <span class=bad>groups ended with different states</span></p>"
        if states > 1
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
        f"{_more(len(story), tl['groups_total'], 'groups')}<h3>committed steps per group</h3>{_chart(tl)}"
    )


CHART_W, CHART_H = 720, 260


def _chart(tl: dict[str, Any]) -> str:
    """The chart of a timeline's summary with its axis titles, and a word when nothing
    happened to mark."""
    from training import timeline

    chart = timeline.svg({}, width=CHART_W, height=CHART_H, s=tl["series"])
    if not chart:
        return "<p class=note>no committed step recorded</p>"
    drawn = _more(len(tl["series"]["groups"]), tl["chart_groups_total"], "groups in the chart")
    drawn += _more(len(tl["series"]["marks"]), tl["marks_total"], "marks in the chart (thinned evenly)")
    quiet = drawn + (
        ""
        if tl["marks_total"]
        else "<p class=note>No faults, failures or heals in this job: nothing to mark. Groups that committed "
        "the same steps at the same times draw one line.</p>"
    )
    chart = chart.replace("<svg ", f"<svg viewBox='0 0 {CHART_W} {CHART_H}' ", 1)  # scales down in a narrow tab
    return (
        f"<div class=chart><span class=ylabel>committed step</span><div class=scroll>{chart}</div>"
        f"<div class=xlabel>seconds since the launch</div></div>{quiet}"
    )


def _short(v: Any) -> str:
    """An event value as a person reads it: a path as its last two parts, long text cut."""
    if isinstance(v, str) and v.startswith("/"):
        v = "…/" + "/".join(v.rstrip("/").split("/")[-2:])
    text = v if isinstance(v, str) else json.dumps(v, separators=(", ", ": "))
    return text if len(text) <= 80 else text[:77] + "…"


def _detail(ev: dict[str, Any]) -> str:
    """At most 12 fields, each cut (`_short`): a planted event with many fields stays one line."""
    fields = itertools.islice(((k, v) for k, v in ev.items() if k not in ("t", "kind")), 12)
    return ", ".join(f"{str(k)[:40]} {_short(v)}" for k, v in fields)


def render(doc: dict[str, Any]) -> str:
    e = html.escape
    st = doc.get("status") or {}
    at = doc.get("fetched_at")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(_num(at))) if at else "-"
    tl = doc.get("timeline")
    state = "live" if doc["live"] else "finished job" if tl else f"snapshot of {when}" if st else "no status"
    q = st.get("quorum") or {}
    groups = "".join(_group_row(g) for g in st.get("groups", []) if isinstance(g, dict))
    evs = list(reversed(tl["events"])) if tl else st.get("events", [])
    evs = evs if isinstance(evs, list) else []
    events = "".join(
        f"<tr><td>{time.strftime('%H:%M:%S', time.localtime(_num(ev.get('t'))))}</td>"
        f"<td>{e(str(ev.get('kind', '')))}</td>"
        f"<td>{e(_detail(ev))}</td></tr>"
        for ev in reversed(evs[-50:])
        if isinstance(ev, dict)
    )
    refresh = "<meta http-equiv='refresh' content='3'>" if doc["live"] or doc.get("pending") else ""
    # a finished job's lighthouse ended with it: its address is history, not a place to look
    where = "its lighthouse ended with the job" if tl else doc["url"] or "no address"
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
.muted{{color:#666}}.warn{{color:#a0a}}.note{{color:#333}}
table,.scroll{{display:block;overflow-x:auto;max-width:100%}}body{{min-width:0}}
.chart{{display:grid;grid-template-columns:auto 1fr;align-items:center;gap:.3rem}}
.ylabel{{writing-mode:vertical-rl;transform:rotate(180deg);font-size:12px;color:#444}}
.xlabel{{grid-column:2;text-align:center;font-size:12px;color:#444}}
svg.ftrec-timeline{{max-width:100%;height:auto}}
@media (max-width:640px){{body{{font-size:13px;margin:.4rem}}td,th{{padding:.1rem .3rem}}
h2{{font-size:1.15rem}}}}</style></head><body>
<h2>ftcore lighthouse</h2>
<p class=muted>{e(doc["source"])} &middot; {e(where)} &middot; {e(state)}</p>
{f"<p class=bad>{e(doc['error'])}</p>" if doc["error"] else ""}
{f"<p class=note>{e(doc['note'])}</p>" if doc.get("note") else ""}
{body}
<h3>recent events</h3><table><tr><th>time</th><th>event</th><th>detail</th></tr>{events}</table>
{_more(min(len(evs), 50), tl["events_total"], "older events") if tl else ""}
</body></html>"""


@app.get("/lighthouse/status")
def status(dag_id: str | None = Query(None), run_id: str | None = Query(None)) -> dict[str, Any]:
    return lookup(dag_id, run_id)


@app.get("/lighthouse/", response_class=HTMLResponse)
def page(dag_id: str | None = Query(None), run_id: str | None = Query(None)) -> str:
    return render(lookup(dag_id, run_id))
