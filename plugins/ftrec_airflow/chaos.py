"""The chaos drill's verdict: did fault-tolerant training survive the fault plan?

The long form: docs/airflow.md, "plugins/ftrec_airflow/chaos"."""

import itertools
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_PLAN = {
    "faults": [{"kind": "kill", "group": 1, "at_step": 6}, {"kind": "kill_lighthouse", "at_step": 14, "duration_s": 1}]
}
GROUP_FAULTS = ("kill", "stop", "raise", "slow")


def load_plan(plan: str | dict) -> dict:
    if isinstance(plan, dict):
        return plan
    text = plan.strip()
    if text.startswith("{"):
        return json.loads(text)
    path = Path(text)
    return tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())


def faulted_groups(plan: dict) -> set[int]:
    return {int(f["group"]) for f in plan.get("faults", []) if f.get("kind") in GROUP_FAULTS and "group" in f}


@dataclass
class ChaosVerdict:
    ok: bool
    problems: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)


def judge(
    timeline: dict,
    run_metrics: dict[str, float],
    plan: dict,
    *,
    replica_groups: int,
    max_stall_s: float,
    artifacts: list[str] | None = None,
) -> ChaosVerdict:
    """The three claims of the module doc, checked on the launcher's `timeline` and the
    run's MLflow metrics and artifacts."""
    faulted = faulted_groups(plan)
    survivors = [g for g in range(replica_groups) if g not in faulted]
    problems = _recovery_problems(run_metrics, plan, artifacts)
    stalls = _survivor_problems(timeline, survivors, max_stall_s, problems)
    sums = _replica_problems(timeline, replica_groups, problems)
    facts = {
        "survivors": survivors,
        "faulted": sorted(faulted),
        "max_commit_gap_s": stalls,
        "checksums": sums,
        "summary": timeline.get("summary", {}),
        "recovery_metrics": {k: v for k, v in run_metrics.items() if k.startswith("ft/")},
    }
    return ChaosVerdict(not problems, problems, facts)


def _recovery_problems(run_metrics: dict[str, float], plan: dict, artifacts: list[str] | None) -> list[str]:
    """1. MLflow shows the recovery the plan's kinds of fault call for."""
    problems: list[str] = []
    kinds = {f.get("kind") for f in plan.get("faults", [])}

    def metric(name: str) -> float:
        return float(run_metrics.get(f"ft/{name}", 0.0))

    if "ft/failures_detected" not in run_metrics:
        problems.append("MLflow run has no ft/* recovery metrics (the launcher did not log them)")
    else:
        if kinds & {"kill", "stop"} and metric("failures_detected") < 1:
            problems.append("MLflow ft/failures_detected = 0 although the plan kills or stops a group")
        if kinds & {"kill", "stop", "raise", "kill_lighthouse"} and metric("quorum_changes") < 1:
            problems.append("MLflow ft/quorum_changes = 0 although the plan injects faults")
        if "kill" in kinds and metric("heals") < 1:
            problems.append("MLflow ft/heals = 0 although the plan kills a group (it never caught up)")
    if artifacts is not None and not any(a.endswith("timeline.json") for a in artifacts):
        problems.append("MLflow run has no timeline.json artifact")
    return problems


def _survivor_problems(timeline: dict, survivors: list[int], max_stall_s: float, problems: list[str]) -> dict:
    """2. Each survivor committed steps 1, 2, 3, ... with no gap over `max_stall_s`; its
    longest gap per group. Adds to `problems`."""
    stalls = {}
    for g in survivors:
        commits = sorted(
            (
                r
                for r in timeline.get("steps", [])
                if r.get("group") == g and r.get("rank", 0) == 0 and r.get("committed")
            ),
            key=lambda r: r["t"],
        )
        steps = [r["step"] for r in commits]
        if not steps:
            problems.append(f"survivor group {g} committed no step")
            continue
        holes = [b for a, b in itertools.pairwise(steps) if b != a + 1]
        if holes:
            problems.append(f"survivor group {g} skipped or repeated steps (jumps to {holes[:5]})")
        gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(commits)]
        stalls[g] = max(gaps, default=0.0)
        if stalls[g] > max_stall_s:
            problems.append(f"survivor group {g} stalled {stalls[g]:.1f} s between commits (limit {max_stall_s} s)")
    return stalls


def _replica_problems(timeline: dict, replica_groups: int, problems: list[str]) -> dict:
    """3. Every group wrote the same final-state checksum and the launcher exited 0; the
    checksums. Adds to `problems`."""
    sums = timeline.get("checksums", {})
    if len(sums) < replica_groups:
        problems.append(f"only {len(sums)} of {replica_groups} replica groups wrote a final state")
    elif len(set(sums.values())) != 1:
        problems.append(f"final replicas differ: {sums}")
    if timeline.get("exit_code", 1) != 0:
        problems.append(f"the launcher exited with {timeline.get('exit_code')}")
    return sums
