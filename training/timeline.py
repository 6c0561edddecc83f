"""The story of one FT-HSDP job, from the launcher's `timeline.json`: committed steps per
replica group over time, with faults, failures, heals and exclusions marked.

The picture an operator wants after a chaos drill. `series()` extracts it once; `svg()`
draws it for the Airflow lighthouse tab (inline, no script, every label escaped) and
`png()` for the job's MLflow run (matplotlib). `story()` is the per-group summary both show.
"""

import html
from collections import Counter
from typing import Any

MAX_POINTS = 400  # per group: a day-long job draws as fast as a short one

# event kind -> (label, colour); where it comes from: the launcher or the lighthouse
MARKS = {
    "fault": ("fault injected", "#b00"),
    "group_failed": ("group failed", "#b00"),
    "failure_detected": ("failure detected", "#e60"),
    "heal_finished": ("healed", "#070"),
    "group_excluded": ("excluded as slow", "#a0a"),
    "group_readmitted": ("readmitted", "#06c"),
    "lighthouse_died": ("lighthouse died", "#555"),
}


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def series(tl: dict[str, Any]) -> dict[str, Any]:
    """{"t0", "groups": {g: [(seconds, step)]}, "marks": [(seconds, group, kind)]}: rank 0's
    commits of each group, and the events worth marking, in seconds since the launch."""
    first = None  # the earliest event of any kind
    raw = []  # (t, group, kind, rank 0's or a launcher's): marks, in seconds since the epoch
    for e in (*tl.get("launcher_events", []), *tl.get("lighthouse_events", [])):  # one pass
        t = _num(e.get("t")) if isinstance(e, dict) else None
        if t is None:
            continue
        first = t if first is None or t < first else first
        if e.get("kind") in MARKS:
            who = e.get("group")
            raw.append((t, int(who) if isinstance(who, int) else None, e["kind"], e.get("rank", 0) == 0))
    steps = [
        s
        for s in tl.get("steps", [])
        if isinstance(s, dict)
        and s.get("committed")
        and s.get("rank", 0) == 0
        and _num(s.get("t")) is not None
        and _num(s.get("step")) is not None
    ]
    # from the first commit (or an earlier fault): the seconds ranks spend starting are not the story
    t0 = min([s["t"] for s in steps] + [m[0] for m in raw], default=first if first is not None else 0.0)
    groups: dict[int, list[tuple[float, int]]] = {}
    for s in sorted(steps, key=lambda s: s["t"]):
        groups.setdefault(int(s.get("group", 0)), []).append((s["t"] - t0, int(s["step"])))
    for g, pts in groups.items():  # thin evenly, keep the last point
        groups[g] = _thin(pts, MAX_POINTS)
    marks = [(max(t - t0, 0.0), g, kind) for t, g, kind, rank0 in raw if kind != "heal_finished" or rank0]
    return {"t0": t0, "groups": dict(sorted(groups.items())), "marks": sorted(marks, key=lambda m: m[0])}


def story(tl: dict[str, Any], s: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per group: committed steps (its last), restarts, failures (the launcher's count: a
    group that failed or hung), heals, exclusions, its final state's checksum, and a note
    saying why there is none. One pass over the events (`s`: series(tl), if already made)."""
    s = s if s is not None else series(tl)
    restarts = tl.get("restarts", {}) or {}
    checksums = tl.get("checksums", {}) or {}
    launcher = [e for e in tl.get("launcher_events", []) if isinstance(e, dict)]
    failures = Counter(e.get("group") for e in launcher if e.get("kind") in ("group_failed", "group_replaced"))
    not_needed = {e.get("group") for e in launcher if e.get("kind") == "group_not_needed"}
    marked = Counter((g, kind) for _, g, kind in s["marks"])
    out = []
    for g in sorted(set(s["groups"]) | {int(k) for k in restarts if str(k).isdigit()}):
        final = checksums.get(str(g), checksums.get(g, ""))
        note = "" if final else "not needed: training finished first" if g in not_needed else "none"
        out.append(
            {
                "group": g,
                "last_step": s["groups"].get(g, [(0, 0)])[-1][1],
                "restarts": restarts.get(str(g), restarts.get(g, 0)),
                "failures": failures.get(g, 0),
                "heals": marked.get((g, "heal_finished"), 0),
                "exclusions": marked.get((g, "group_excluded"), 0),
                "checksum": final,
                "note": note,
            }
        )
    return out


def _thin(items: list, most: int) -> list:
    """At most `most` + 1 of `items`, evenly spaced, the last kept."""
    if len(items) <= most:
        return items
    every = len(items) / most
    return [items[int(i * every)] for i in range(most)] + [items[-1]]


def summary(tl: dict[str, Any], groups: int = 64, chart_groups: int = 16, marks: int = 200, events: int = 50) -> dict:
    """What a page shows of a timeline, bounded whatever its size, in time linear in it:
    the story of the first `groups` groups, a chart series of the first `chart_groups` with
    at most `marks` marks, the `events` newest events (newest first), and the totals."""
    import heapq

    s = series(tl)
    rows = story(tl, s)
    evs = [e for e in [*tl.get("launcher_events", []), *tl.get("lighthouse_events", [])] if isinstance(e, dict)]
    kinds = Counter(str(e.get("kind", "")) for e in evs)
    shown = dict(list(s["groups"].items())[:chart_groups])
    return {
        "exit_code": tl.get("exit_code"),
        "groups": rows[:groups],
        "groups_total": len(rows),
        "states": len({r["checksum"] for r in rows if r["checksum"]}),
        "series": {"t0": s["t0"], "groups": shown, "marks": _thin(s["marks"], marks)},
        "chart_groups_total": len(s["groups"]),
        "marks_total": len(s["marks"]),
        "events": heapq.nlargest(events, evs, key=lambda e: _num(e.get("t")) or 0.0),
        "events_total": len(evs),
        "kinds": dict(kinds),
    }


PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def svg(tl: dict[str, Any], width: int = 720, height: int = 260, s: dict[str, Any] | None = None) -> str:
    """Committed steps per group over time as inline SVG (empty string without commits);
    `s`: the series to draw (default series(tl), e.g. summary()'s bounded one)."""
    s = s if s is not None else series(tl)
    pts = [p for g in s["groups"].values() for p in g]
    if not pts:
        return ""
    pad_l, pad_r, pad_t, pad_b = 48, 130, 12, 32
    t_max = max([p[0] for p in pts] + [m[0] for m in s["marks"]] + [1e-9])
    y_max = max(p[1] for p in pts) or 1

    def x(t: float) -> float:
        return pad_l + (width - pad_l - pad_r) * t / t_max

    def y(v: float) -> float:
        return height - pad_b - (height - pad_t - pad_b) * v / y_max

    e = html.escape
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img' "
        f"aria-label='committed steps per replica group over time' class='ftrec-timeline'>",
        f"<line x1='{pad_l}' y1='{y(0):.1f}' x2='{width - pad_r}' y2='{y(0):.1f}' stroke='#999'/>",
        f"<line x1='{pad_l}' y1='{pad_t}' x2='{pad_l}' y2='{y(0):.1f}' stroke='#999'/>",
        f"<text x='{pad_l}' y='{height - 8}' font-size='11'>0 s</text>",
        f"<text x='{width - pad_r}' y='{height - 8}' font-size='11' text-anchor='end'>{t_max:.1f} s</text>",
        f"<text x='{pad_l - 4}' y='{pad_t + 10}' font-size='11' text-anchor='end'>{y_max}</text>",
        f"<text x='{pad_l - 4}' y='{y(0):.1f}' font-size='11' text-anchor='end'>0</text>",
    ]
    for i, (g, line) in enumerate(s["groups"].items()):
        colour = PALETTE[i % len(PALETTE)]
        path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in line)
        out.append(
            f"<polyline class='group' data-group='{g}' fill='none' stroke='{colour}' stroke-width='1.5' "
            f"points='{path}'/>"
        )
        out.append(
            f"<text x='{width - pad_r + 8}' y='{pad_t + 14 * (i + 1)}' font-size='11' fill='{colour}'>group {g}</text>"
        )
    kinds = []
    for t, g, kind in s["marks"]:
        label, colour = MARKS[kind]
        who = f"group {g}: " if g is not None else ""
        out.append(
            f"<line class='mark' data-kind='{e(kind)}' x1='{x(t):.1f}' y1='{pad_t}' x2='{x(t):.1f}' "
            f"y2='{y(0):.1f}' stroke='{colour}' stroke-dasharray='3,3'><title>{e(who + label)} "
            f"at {t:.2f} s</title></line>"
        )
        if kind not in kinds:
            kinds.append(kind)
    for j, kind in enumerate(kinds):
        label, colour = MARKS[kind]
        out.append(
            f"<text x='{width - pad_r + 8}' y='{pad_t + 14 * (len(s['groups']) + j + 2)}' font-size='11' "
            f"fill='{colour}'>- - {e(label)}</text>"
        )
    out.append("</svg>")
    return "".join(out)


def png(tl: dict[str, Any], path: str) -> bool:
    """The same chart as a PNG (for MLflow); False when there is nothing to draw."""
    s = series(tl)
    if not s["groups"]:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    for g, line in s["groups"].items():
        ax.plot([p[0] for p in line], [p[1] for p in line], label=f"group {g}", linewidth=1.2)
    seen = set()
    for t, _, kind in s["marks"]:
        label, colour = MARKS[kind]
        ax.axvline(t, color=colour, linestyle="--", linewidth=0.8, label=None if kind in seen else label)
        seen.add(kind)
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("committed step")
    ax.set_title("committed steps per replica group")
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
