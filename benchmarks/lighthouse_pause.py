"""A lighthouse pause in a real job: what the survivors lose, with and without the lease.

    python benchmarks/lighthouse_pause.py [--pause 3] [--json PATH]

The launcher runs the toy trainer (ftcore/examples/toy.py), 3 replica groups, step ~40 ms;
at step 40 the fault plan SIGSTOPs the lighthouse for --pause seconds, then SIGCONTs it.
Two runs, one after the other:

- lease: the defaults (a group whose quorum is unchanged goes on while the lighthouse is
  silent, FTCORE_LEASE; the returning lighthouse grants a grace period, FTCORE_PAUSE_JUMP);
- before: FTCORE_LEASE=0 and no pause grace (every step waits for the lighthouse, and the
  returning lighthouse judges everyone's silence at once), as before this change.

Reported: the survivors' longest stall beyond one step from the pause until the run ends
(longest gap between two commits of a group, minus the median step), steps committed while
the lighthouse was stopped, failures declared, heals.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.launcher import launch, toy  # noqa: E402

MODES = {"lease": {}, "before": {"FTCORE_LEASE": "0", "FTCORE_PAUSE_JUMP": "1e9"}}


def run(mode: str, pause: float, steps: int = 200) -> dict:
    with tempfile.TemporaryDirectory() as d:
        faults = [{"kind": "pause_lighthouse", "at_step": 40, "duration_s": pause}]
        try:
            tl = launch(os.path.join(d, "run"), faults, toy(steps, 0.03), env=MODES[mode], timeout=300)
        except RuntimeError as e:
            raise RuntimeError(f"{mode}: {e}") from None
    t_pause = next(e["t"] for e in tl["launcher_events"] if e.get("fault") == "pause_lighthouse")
    t_resume = next(e["t"] for e in tl["launcher_events"] if e["kind"] == "fault_resumed")
    commits: dict[int, list[dict]] = {}
    for s in tl["steps"]:
        if s["committed"] and s["rank"] == 0:
            commits.setdefault(s["group"], []).append(s)
    gaps, during = [], 0
    step_s = statistics.median(b["t"] - a["t"] for v in commits.values() for a, b in zip(v, v[1:], strict=False))
    for v in commits.values():
        v.sort(key=lambda s: s["t"])
        ts = [s["t"] for s in v]
        gaps += [b - a for a, b in zip(ts, ts[1:], strict=False) if b >= t_pause]
        during += sum(t_pause <= t <= t_resume for t in ts)
    kinds = [e["kind"] for e in tl["lighthouse_events"]]
    return {
        "mode": mode,
        "pause_s": round(t_resume - t_pause, 3),
        "step_s": round(step_s, 4),
        "max_stall_s": round(max(gaps, default=0) - step_s, 3),
        "steps_committed_during_pause": during,
        "failures_detected": kinds.count("failure_detected"),
        "heals": kinds.count("heal_finished"),
        "leased_steps": sum(1 for s in tl["steps"] if s.get("leased")),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pause", type=float, default=3.0)
    p.add_argument("--json", default=str(ROOT / "bench-results" / "lighthouse_pause.json"))
    a = p.parse_args()
    rows = [run(m, a.pause) for m in MODES]
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
