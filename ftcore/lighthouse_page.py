"""The lighthouse's own HTML page (GET /): one job's groups and recent events."""

import html
import json
import time
import urllib.parse
from typing import Any


def status_html(st: dict[str, Any]) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(str(g['group']))}</td><td>{e(str(g['incarnation']))}</td>"
        f"<td>{'standby (slow)' if g.get('standby_s') else 'yes' if g['healthy'] else 'no'}</td>"
        f"<td>{e(str(g['step']))}</td><td>{e(str(g['ranks']))}/{e(str(g['world']))}</td></tr>"
        for g in st["groups"]
    )
    q = st["quorum"] or {}
    evs = "".join(
        f"<li>{time.strftime('%H:%M:%S', time.localtime(float(ev.get('t', 0))))} {e(json.dumps(ev))}</li>"
        for ev in reversed(st["events"][-30:])
    )
    jobs = ", ".join(f"<a href='?job={e(urllib.parse.quote(j))}'>{e(j)}</a>" for j in st["jobs"]) or "none yet"
    return (
        "<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='2'>"
        "<title>ftcore lighthouse</title></head><body style='font-family:sans-serif'>"
        f"<h1>ftcore lighthouse</h1><p>jobs: {jobs}</p><h2>job {e(st['job'])}</h2>"
        f"<p>quorum {e(str(q.get('quorum_id', '-')))}: groups {e(str(q.get('groups', [])))}, "
        f"max committed step {e(str(st['max_step']))}, min replicas {e(str(st['min_replicas']))}</p>"
        "<table border=1 cellpadding=4><tr><th>group</th><th>incarnation</th><th>healthy</th>"
        f"<th>step</th><th>ranks</th></tr>{rows}</table><h2>recent events</h2><ul>{evs}</ul></body></html>"
    )
