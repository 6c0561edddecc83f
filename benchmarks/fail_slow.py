"""One slow replica group in a real job: the job's commit rate with the fail-slow policy off and on.

    python benchmarks/fail_slow.py [--reps 2] [--json PATH]

The launcher runs the toy trainer (ftcore/examples/toy.py), 3 replica groups, 300 steps of
~35 ms. A fault plan makes group 2 sleep --delay seconds in each of its steps 20..200 (a
group several times slower than its peers, as a throttled GPU or a noisy host is). Modes,
interleaved, --reps times each:

- off:   FTCORE_SLOW_RATIO=0, every step waits for the slow group (before this policy);
- on:    the defaults (ftcore/pace.py): excluded after FTCORE_SLOW_WINDOW rounds, held on
         standby, readmitted through a heal when only its own make-up work is left;
- clean: the policy on and nobody slowed: it must exclude nobody (false positives).

Reported: group 0's commits per second from its step 30 to its step 200 (the slow
stretch), the job's wall time (launcher start to end, make-up included: the data stays
exactly once, so the excluded group's batches are trained after), exclusions, heals, and
whether all groups ended with the same state.
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

MODES = {"off": {"FTCORE_SLOW_RATIO": "0"}, "on": {}, "clean": {}}


def run(mode: str, delay: float, steps: int = 300) -> dict:
    with tempfile.TemporaryDirectory() as d:
        faults = (
            []
            if mode == "clean"
            else [{"kind": "slow", "group": 2, "at_step": 20, "until_step": 200, "delay_s": delay}]
        )
        try:
            tl = launch(os.path.join(d, "run"), faults, toy(steps, 0.03), env=MODES[mode], timeout=300)
        except RuntimeError as e:
            raise RuntimeError(f"{mode}: {e}") from None
        wall = tl["wall_s"]
    t = {s["step"]: s["t"] for s in tl["steps"] if s["committed"] and s["group"] == 0 and s["rank"] == 0}
    kinds = [e["kind"] for e in tl["lighthouse_events"]]
    return {
        "mode": mode,
        "commits_per_s_slow_stretch": round(170 / (t[200] - t[30]), 2),
        "job_wall_s": round(wall, 2),
        "committed_steps": max(t),
        "exclusions": kinds.count("group_excluded"),
        "heals": kinds.count("heal_assigned"),
        "identical": len(set(tl["checksums"].values())) == 1,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--delay", type=float, default=0.1, help="seconds the slow group sleeps per step")
    p.add_argument("--json", default=str(ROOT / "bench-results" / "fail_slow.json"))
    a = p.parse_args()
    rows = [run(m, a.delay) for _ in range(a.reps) for m in MODES]
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    med = {
        m: {
            k: statistics.median(r[k] for r in rows if r["mode"] == m)
            for k in ("commits_per_s_slow_stretch", "job_wall_s")
        }
        for m in MODES
    }
    print(
        f"\nmedian commit rate on/off while slowed: "
        f"{med['on']['commits_per_s_slow_stretch'] / med['off']['commits_per_s_slow_stretch']:.2f}x; "
        f"job wall time on/off: {med['on']['job_wall_s'] / med['off']['job_wall_s']:.2f}; "
        f"clean/off commit rate "
        f"{med['clean']['commits_per_s_slow_stretch'] / med['off']['commits_per_s_slow_stretch']:.2f}x"
    )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"rows": rows, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
