"""False failures in a benchmark's lighthouse events: a `failure_detected` for a group that was
not faulted, or before its fault. A benchmark counts them and fails when there is any."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

SLACK_S = 0.05  # a fault's recorded time and the lighthouse's clock: the same machine, two processes


def false_failures(
    events: Iterable[dict], faulted: Mapping[int, Iterable[float]], within_s: float = 30.0
) -> list[dict]:
    """The `failure_detected` events (wall-clock "t") that no fault explains: `faulted` maps each
    faulted group to its faults' wall-clock times; a verdict counts as explained within `within_s`
    after one of them."""
    times = {g: sorted(ts) for g, ts in faulted.items()}
    wrong = []
    for e in events:
        if e.get("kind") != "failure_detected":
            continue
        t, g = e["t"], e.get("group", -1)
        if not any(f - SLACK_S <= t <= f + within_s for f in times.get(g, ())):
            wrong.append(e)
    return wrong


def describe(wrong: list[dict], limit: int = 5) -> str:
    """A line for the report: how many, and the first few (group, reason)."""
    shown = ", ".join(f"group {e.get('group')} ({e.get('reason', '?')})" for e in wrong[:limit])
    return f"{len(wrong)} false failure(s): {shown}{' ...' if len(wrong) > limit else ''}"
