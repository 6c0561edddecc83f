"""A timeline's bounded summary as a file: what the launcher writes beside timeline.json
(`write`), what the Airflow Lighthouse tab reads instead of parsing the timeline on its API
server (`bounded`, `stamp`), and the child process the tab runs for a timeline without one
(`main`: `python -m training.timeline_summary --max-bytes N < timeline.json`).

The file: {"timeline": stamp of the timeline.json it summarizes, "summary": training.timeline.
summary of it, `bounded`}. The stamp is {"size", "sha256"} of the timeline's bytes, not its
times: a copied run folder still matches, a timeline replaced or planted beside it never does.
"""

import argparse
import hashlib
import json
import math
import os
import resource
import sys
from typing import IO, Any

from training import timeline

FILE = "timeline.summary.json"
TIMELINE = "timeline.json"
# the most a summary holds: training.timeline.summary's defaults, and a cap on every text
GROUPS, CHART_GROUPS, POINTS, MARKS, EVENTS, KINDS = 64, 16, timeline.MAX_POINTS + 1, 201, 50, 32
FIELDS, TEXT, NAME = 12, 100, 40  # the page shows 12 fields of an event, each value to 80 characters
BIG = 1 << 63


def stamp(data: "bytes | IO[bytes]") -> dict[str, Any]:
    """{"size", "sha256"} of `data`: bytes, or a binary file read from its start in pieces."""
    h, size = hashlib.sha256(), 0
    if isinstance(data, bytes):
        h.update(data)
        return {"size": len(data), "sha256": h.hexdigest()}
    data.seek(0)
    while chunk := data.read(1 << 20):
        h.update(chunk)
        size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def stamp_of(doc: Any) -> dict[str, Any]:
    """The stamp a summary file holds; ValueError when it holds none."""
    st = doc.get("timeline") if isinstance(doc, dict) else None
    if not isinstance(st, dict) or not isinstance(st.get("sha256"), str):
        raise ValueError("timeline: no stamp {size, sha256}")
    return {"size": _count(st.get("size"), "timeline.size"), "sha256": st["sha256"]}


def write(out: str, tl: dict[str, Any]) -> None:
    """OUT/timeline.json and, first, OUT/timeline.summary.json stamped with its bytes (a
    crash between the two leaves a summary whose stamp matches nothing, which is ignored)."""
    from ftcore.util.files import atomic_write_bytes, atomic_write_json

    data = json.dumps(tl).encode()
    try:
        doc = {"timeline": stamp(data), "summary": bounded(timeline.summary(tl))}
    except ValueError as e:  # the page summarizes the timeline itself
        print(f"[launch] no {FILE}: {e}", flush=True)
    else:
        atomic_write_json(os.path.join(out, FILE), doc)
    atomic_write_bytes(os.path.join(out, TIMELINE), data)


def summarize_json(raw: bytes) -> dict[str, Any]:
    """The bytes of a timeline.json summarized and bounded; ValueError when they are not one."""
    try:
        tl = json.loads(raw)
        if not isinstance(tl, dict):
            raise ValueError("not a JSON object")
        return bounded(timeline.summary(tl))
    except (TypeError, AttributeError, KeyError, OverflowError, IndexError, RecursionError) as e:
        raise ValueError(f"not a timeline ({type(e).__name__})") from None


def bounded(s: Any) -> dict[str, Any]:
    """`s` (training.timeline.summary's output, or it read back from JSON) checked field by
    field and cut to the caps above; ValueError naming the first field at fault."""
    d = _dict(s, "summary")
    ser = _dict(d.get("series"), "series")
    code = d.get("exit_code")
    return {
        "exit_code": None if code is None else _int(code, "exit_code"),
        "groups": [_row(r, f"groups[{i}]") for i, r in enumerate(_list(d.get("groups"), "groups", GROUPS))],
        "groups_total": _count(d.get("groups_total"), "groups_total"),
        "states": _count(d.get("states"), "states"),
        "series": {
            "t0": _num(ser.get("t0"), "series.t0"),
            "groups": _lines(ser.get("groups")),
            "marks": [_mark(m, f"series.marks[{i}]") for i, m in enumerate(_list(ser.get("marks"), "marks", MARKS))],
        },
        "chart_groups_total": _count(d.get("chart_groups_total"), "chart_groups_total"),
        "marks_total": _count(d.get("marks_total"), "marks_total"),
        "events": [_event(e, f"events[{i}]") for i, e in enumerate(_list(d.get("events"), "events", EVENTS))],
        "events_total": _count(d.get("events_total"), "events_total"),
        "kinds": _kinds(d.get("kinds")),
    }


def _dict(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise ValueError(f"{where}: not an object")
    return v


def _list(v: Any, where: str, most: int) -> list:
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"{where}: not a list")
    return list(v[:most])


def _int(v: Any, where: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not -BIG < v < BIG:
        raise ValueError(f"{where}: not an integer")
    return v


def _count(v: Any, where: str) -> int:
    if _int(v, where) < 0:
        raise ValueError(f"{where}: negative")
    return v


def _num(v: Any, where: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or abs(v) >= BIG:
        raise ValueError(f"{where}: not a finite number")
    return float(v)


def _text(v: Any, where: str, most: int = TEXT) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{where}: not text")
    return v[:most]


def _row(r: Any, where: str) -> dict[str, Any]:
    r = _dict(r, where)
    out: dict[str, Any] = {"group": _int(r.get("group"), f"{where}.group")}
    out["last_step"] = _int(r.get("last_step"), f"{where}.last_step")
    for k in ("restarts", "failures", "heals", "exclusions"):
        out[k] = _count(r.get(k), f"{where}.{k}")
    out["checksum"] = _text(r.get("checksum"), f"{where}.checksum", 128)
    out["note"] = _text(r.get("note"), f"{where}.note")
    return out


def _lines(v: Any) -> dict[int, list[tuple[float, int]]]:
    """series.groups: {group: [(seconds, step)]}; JSON's string keys back to the ints they were."""
    out = {}
    for g, pts in list(_dict(v, "series.groups").items())[:CHART_GROUPS]:
        key = int(g) if isinstance(g, str) and g.lstrip("-").isdigit() and len(g) < 19 else g
        where = f"series.groups[{str(g)[:20]}]"
        out[_int(key, where)] = [
            (_num(p[0], where), _int(p[1], where)) if isinstance(p, (list, tuple)) and len(p) == 2 else _bad(where)
            for p in _list(pts, where, POINTS)
        ]
    return out


def _mark(m: Any, where: str) -> tuple[float, int | None, str]:
    if not isinstance(m, (list, tuple)) or len(m) != 3 or m[2] not in timeline.MARKS:
        raise ValueError(f"{where}: not (seconds, group, kind)")
    return _num(m[0], where), None if m[1] is None else _int(m[1], where), m[2]


def _event(e: Any, where: str) -> dict[str, Any]:
    """An event cut to its time, kind and `FIELDS` other fields, each value a scalar or a text."""
    e = _dict(e, where)
    out: dict[str, Any] = {}
    t = e.get("t")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < 1e11:  # a time the page can print
        out["t"] = t
    if "kind" in e:
        out["kind"] = str(e["kind"])[:NAME] if isinstance(e["kind"], (str, int)) else "?"
    others = [(k, v) for k, v in e.items() if k not in ("t", "kind")][:FIELDS]
    for k, v in others:
        out[str(k)[:NAME]] = v if _scalar(v) else v[:TEXT] if isinstance(v, str) else _shown(v)
    return out


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, bool) or (isinstance(v, (int, float)) and math.isfinite(v) and abs(v) < BIG)


def _shown(v: Any) -> str:
    try:
        return json.dumps(v)[:TEXT]
    except (ValueError, TypeError, RecursionError):
        return "?"


def _kinds(v: Any) -> dict[str, int]:
    """kind -> count, the `KINDS` most frequent."""
    counts = [(str(k)[:NAME], _count(n, "kinds")) for k, n in _dict(v, "kinds").items()]
    return dict(sorted(counts, key=lambda kn: -kn[1])[:KINDS])


def _bad(where: str) -> Any:
    raise ValueError(f"{where}: not (seconds, step)")


def main(argv: list[str] | None = None) -> int:
    """The page's child: the timeline on stdin (at most --max-bytes) summarized and bounded, as
    JSON on stdout; exit status 2 and one line on stderr when it is not a timeline."""
    p = argparse.ArgumentParser(description="summarize the timeline.json on stdin")
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--max-memory", type=int, help="address space cap (default 16 x max-bytes + 256 MiB)")
    a = p.parse_args(argv)
    try:
        os.nice(10)  # a page's background work, behind the API server's requests
    except OSError:
        pass
    # a real 64 MiB timeline peaks near 550 MiB; a planted one of tiny objects could take 20x its size
    cap = a.max_memory or 16 * a.max_bytes + (256 << 20)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = cap if hard == resource.RLIM_INFINITY else min(cap, hard)  # never above a limit set for us
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    try:
        raw = sys.stdin.buffer.read(a.max_bytes + 1)
        if len(raw) > a.max_bytes:
            raise ValueError(f"over {a.max_bytes} bytes")
        out = summarize_json(raw)
    except ValueError as e:
        print(f"timeline: {e}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"timeline: summarizing it needs over {cap >> 20} MiB", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
