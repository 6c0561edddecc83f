"""Survivors' stall per failure, with the toy and with the real trainer, under plain and compound faults.

    python benchmarks/stall.py [--worker toy|trainer|both] [--load quiet hog] [--json PATH]

The launcher runs 3 replica groups (4 for `together`) with warm spares and a fault plan:

- single:      kill -9 of one group 4 times, 9 s apart (groups 2, 1, 2, 1);
- during_heal: kill -9 of group 1; group 0, the peer it heals from, kills itself while it
               serves that heal (a second failure during recovery): group 1 must heal again
               from group 2, and group 0 come back and heal as well;
- together:    4 groups, kill -9 of groups 1 and 2 at the same step (two failures at once).

For every survivor (a group the faults did not touch) and every fault episode (from the
first kill to the last returning group's first commit, plus one step), its commit gaps give:

- extra stall: the episode's span minus the steps it committed times the median step time
  (what the failure cost it beyond the steps it trained anyway);
- longest gap beyond one step: its longest single wait, minus one step time;
- at each failure: its wait across each failure the lighthouse detected (the two commits
  around it), minus one step time: what that failure itself cost it.

Goals (issue #16): extra stall per single failure <= 1 step (median of >= 4 kills); under
compound faults no survivor waits longer than one failure-detection interval
(FTCORE_FAILURE_PROBE, 0.2 s), and never a heartbeat timeout (FTCORE_HEARTBEAT_TIMEOUT, 2 s).
Every run counts false failures: a `failure_detected` for a group the plan did not kill, or
before it did (any: the benchmark exits 1), and reports the survivors' p99 gap between commits
over the whole run; each scenario runs quiet and beside a CPU hog (benchmarks/hog.py), in turn.
`--partitions S` adds faults that close no connection (benchmarks/partition.py, simulated hosts,
root only): the lighthouse's host and one group's host cut off for S seconds; each survivor's
longest wait while the link was down.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import hog, verdicts  # noqa: E402
from benchmarks.launcher import launch, toy  # noqa: E402
from ftcore import timeouts  # noqa: E402  (after the repo root is on the path)

SCENARIOS: dict[str, tuple[int, list[list[dict]]]] = {
    # name: (groups, episodes: the faults of each episode, fired in order, far enough apart to settle)
    # 9 s apart: the launcher has a warm spare again for each kill (it refills one 2 s after
    # using it, and a process takes a few seconds to import torch here)
    "single": (
        3,
        [
            [{"kind": "kill", "group": g, "at_time": t, "incarnation": i}]
            for g, t, i in ((2, 12.0, 0), (1, 21.0, 0), (2, 30.0, 1), (1, 39.0, 1))
        ],
    ),
    "during_heal": (
        3,
        [
            [
                {"kind": "kill", "group": 1, "at_step": 30},
                {"kind": "kill", "group": 0, "phase": "heal_serve", "at_step": 30},
            ]
        ],
    ),
    "together": (4, [[{"kind": "kill", "group": 1, "at_step": 30}, {"kind": "kill", "group": 2, "at_step": 30}]]),
}


def _shards(folder: str) -> str:
    """A synthetic shard set for the real trainer (as tests/conftest.py builds one), for 3 and 4
    groups of one rank (world size 12), about 30 steps per epoch."""
    events, shards = os.path.join(folder, "events.txt"), os.path.join(folder, "shards")
    for args in (
        ["-m", "dataprep", "synth", "--out", events, "--users", "6000", "--items", "300", "--quiet"],
        [
            "-m",
            "dataprep",
            "shards",
            "--input",
            events,
            "--format",
            "sasrec",
            "--out",
            shards,
            "--world-size",
            "12",
            "--batch-size",
            "16",
            "--max-len",
            "20",
            "--quiet",
        ],
    ):
        subprocess.run(
            [sys.executable, *args],
            cwd=ROOT,
            check=True,
            timeout=300,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    return shards


# steps per run: both workers train for about a minute (toy steps 50 ms, trainer steps ~25 ms), so
# the last kill's group is back well before the survivors run out of work and wait for its make-up
STEPS = {"toy": 1100, "trainer": 2200}


def run(worker: str, groups: int, faults: list[dict], folder: str, shards: str | None) -> dict:
    """One launcher run of `worker` ("toy" or "trainer") under `faults`; its timeline."""
    if worker == "toy":
        cmd = toy(STEPS["toy"], 0.04)
    else:
        per_epoch = json.loads(Path(str(shards), "manifest.json").read_text())["steps"]
        epochs = -(-STEPS["trainer"] // per_epoch)
        cmd = (
            ["--shards", str(shards)],
            [
                "--set",
                f"train.epochs={epochs}",
                "model.dim=16",
                "loss.kind=sampled_softmax",
                "loss.num_negatives=16",
                "mlflow.enabled=false",
                "eval.periodic=false",
                "eval.final=false",
                "train.checkpoint_every=0",
            ],  # no checkpoint pauses inside the episodes
        )
    return launch(
        os.path.join(folder, "run"), faults, cmd, groups=groups, options=["--max-restarts", "20"], timeout=500
    )


def episodes(tl: dict, groups: int, episode_faults: list[list[dict]]) -> list[dict]:
    """Per episode: its kills' times, and each survivor's extra stall and longest gap."""
    commits: dict[int, list[float]] = {}
    for s in tl["steps"]:
        if s["committed"]:
            commits.setdefault(s["group"], []).append(s["t"])
    for v in commits.values():
        v.sort()
    step_s = statistics.median(b - a for v in commits.values() for a, b in zip(v, v[1:], strict=False))
    kills = sorted(
        (e["t"], e["group"]) for e in tl["launcher_events"] if e["kind"] == "fault" and e.get("fault") == "kill"
    )
    # in-process kills (phase=...) leave no launcher event: their restart does
    restarts = sorted(
        (e["t"], e["group"])
        for e in tl["launcher_events"]
        if e["kind"] == "group_started" and e.get("incarnation", 0) > 0
    )
    rows, touched = [], {f["group"] for ep in episode_faults for f in ep}
    # kills less than 2 s apart are one episode (the launcher fires a step's faults from separate threads)
    starts = [t for i, (t, _) in enumerate(kills) if i == 0 or t - kills[i - 1][0] > 2.0]
    failed = sorted((e["t"], e["group"]) for e in tl["lighthouse_events"] if e["kind"] == "failure_detected")
    for t_kill, t_next in zip(starts, [*starts[1:], float("inf")], strict=True):
        window = [(t, g) for t, g in kills + restarts if t_kill - 0.01 <= t < min(t_next, t_kill + 30)]
        # a hit group is back at its first commit after its last kill or restart in the episode
        # (a heal source that dies while serving committed in between: that is not its return)
        back = [
            next((t for t in commits.get(g, []) if t > max(t_kill + 0.05, *(u for u, h in window if h == g))), None)
            for g in {g for _, g in window}
        ]
        if not back or None in back:
            continue
        end = max(b for b in back if b is not None) + step_s
        for g in sorted(set(range(groups)) - touched):
            before = [t for t in commits[g] if t <= t_kill]
            inside = [t for t in commits[g] if t_kill < t <= end]
            if not before or not inside:
                continue
            done = [before[-1], *inside]
            gaps = [b - a for a, b in zip(done, inside, strict=False)]
            rows.append(
                {
                    "t_kill": t_kill,
                    "survivor": g,
                    "groups_hit": sorted({h for _, h in window}),
                    "step_s": step_s,
                    "extra_stall_s": max(inside[-1] - before[-1] - len(inside) * step_s, 0.0),
                    "longest_gap_beyond_step_s": max(max(gaps) - step_s, 0.0),
                    # the survivor's wait across each failure the lighthouse detected, beyond a step
                    "gap_at_failure_s": [
                        max(_spanning(done, t) - step_s, 0.0) for t, h in failed if t_kill - 0.01 <= t <= end and h != g
                    ],
                }
            )
    return rows


def judged(tl: dict, groups: int, episode_faults: list[list[dict]]) -> dict:
    """The run's verdicts and the survivors' commit gaps: false failures (a verdict on a group no
    fault hit, or before its fault: an in-process fault, which the launcher does not log, counts
    from its episode's first kill) and the p99 of every untouched group's gaps between commits."""
    kills = sorted(
        (e["t"], e["group"]) for e in tl["launcher_events"] if e["kind"] == "fault" and e.get("fault") == "kill"
    )
    faulted: dict[int, list[float]] = {}
    for t, g in kills:
        faulted.setdefault(g, []).append(t)
    first = kills[0][0] if kills else float("inf")
    for f in (f for ep in episode_faults for f in ep if "phase" in f):
        faulted.setdefault(f["group"], []).append(first)
    wrong = verdicts.false_failures(tl["lighthouse_events"], faulted)
    touched = {f["group"] for ep in episode_faults for f in ep}
    gaps = []
    for g in sorted(set(range(groups)) - touched):
        ts = sorted(s["t"] for s in tl["steps"] if s["committed"] and s["group"] == g)
        gaps += [b - a for a, b in zip(ts, ts[1:], strict=False)]
    gaps.sort()
    return {
        "false_failures": len(wrong),
        "false_failure_reasons": sorted({str(e.get("reason")) for e in wrong}),
        "survivor_gap_p99_s": gaps[int(0.99 * (len(gaps) - 1))] if gaps else None,
    }


def _spanning(commits: list[float], t: float) -> float:
    """The gap between the commits around time t (sorted commits)."""
    after = next((c for c in commits if c > t), commits[-1])
    before = max((c for c in commits if c <= t), default=commits[0])
    return after - before


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=("toy", "trainer", "both"), default="both")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--load", nargs="+", choices=hog.LOADS, default=list(hog.LOADS), help="quiet, beside a CPU hog")
    p.add_argument("--json", default=str(ROOT / "bench-results" / "stall.json"))
    p.add_argument("--keep", metavar="DIR", help="keep each run's folder (timeline.json, logs) under DIR")
    p.add_argument("--partitions", type=float, default=0.0, metavar="S", help="also cut links for S seconds")
    return p.parse_args()


def _one(worker: str, name: str, load: str, d: str, shards: str | None) -> dict:
    """One scenario's run and its figures (or the error that ended it)."""
    groups, eps = SCENARIOS[name]
    folder = tempfile.mkdtemp(dir=d, prefix=f"{worker}-{name}-{load}-")
    t = time.time()
    try:
        with hog.load(load):
            tl = run(worker, groups, [f for ep in eps for f in ep], folder, shards)
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # report it, go on with the others
        print(f"{worker} {name} {load}: {str(e)[-1500:]}", flush=True)
        return {"worker": worker, "scenario": name, "load": load, "rows": [], "error": str(e)[-2000:]}
    rows = episodes(tl, groups, eps)
    print(f"{worker} {name} {load}: {len(rows)} samples, {time.time() - t:.0f} s", flush=True)
    return {
        "worker": worker,
        "scenario": name,
        "load": load,
        "rows": rows,
        "wall_s": time.time() - t,
        "identical_states": len(set(tl.get("checksums", {}).values())) <= 1,
        "heartbeat_timeouts": sum(1 for e in tl["lighthouse_events"] if e.get("reason") == "heartbeat timeout"),
        **judged(tl, groups, eps),
    }


def main() -> int:
    a = _args()
    workers = ("toy", "trainer") if a.worker == "both" else (a.worker,)
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        d = a.keep or tmp
        os.makedirs(d, exist_ok=True)
        shards = _shards(d) if "trainer" in workers else None
        for worker in workers:
            for name in a.scenarios.split(","):
                results += [_one(worker, name, load, d, shards) for load in a.load]
    _report(results)
    cuts = _partitions(a.partitions) if a.partitions else []
    probe, hb = timeouts.FAILURE_PROBE, timeouts.HEARTBEAT_TIMEOUT
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(
        json.dumps({"failure_probe_s": probe, "heartbeat_timeout_s": hb, "runs": results, "partitions": cuts}, indent=1)
    )
    wrong = sum(r.get("false_failures", 0) for r in results) + sum(c["false_failures"] for c in cuts)
    print(f"false failures: {wrong}")
    return 1 if wrong else 0


def _report(results: list[dict]) -> None:
    """The table; each run's summary is added to it (for the JSON)."""
    print(
        f"failure-detection interval {timeouts.FAILURE_PROBE:.2f} s, "
        f"heartbeat timeout {timeouts.HEARTBEAT_TIMEOUT:.1f} s"
    )
    print(
        f"{'worker':8} {'scenario':12} {'load':5} {'step s':>7} {'extra stall, median (steps)':>28} "
        f"{'longest gap beyond a step, max':>31} {'gap p99 s':>9} {'hb timeouts':>11} {'false fails':>11} "
        f"{'same state':>10}  samples (s)"
    )
    for r in results:
        rows = r["rows"]
        if not rows:
            print(f"{r['worker']:8} {r['scenario']:12} {r['load']:5} no complete episode")
            continue
        step = rows[0]["step_s"]
        extra = statistics.median(x["extra_stall_s"] for x in rows)
        longest = max(x["longest_gap_beyond_step_s"] for x in rows)
        r["summary"] = {
            "step_s": step,
            "extra_stall_median_s": extra,
            "extra_stall_median_steps": extra / step,
            "longest_gap_beyond_step_max_s": longest,
            "gap_at_failure_s": [v for x in rows for v in x["gap_at_failure_s"]],
        }
        samples = ", ".join(f"{x['extra_stall_s']:.3f}" for x in rows)
        at_failure = ", ".join(f"{v:.3f}" for x in rows for v in x["gap_at_failure_s"])
        print(
            f"{r['worker']:8} {r['scenario']:12} {r['load']:5} {step:7.3f} {extra:16.3f} ({extra / step:4.2f}) "
            f"{longest:31.3f} {r['survivor_gap_p99_s'] or 0:9.3f} {r['heartbeat_timeouts']:11d} "
            f"{r['false_failures']:11d} {str(r['identical_states']):>10}  {samples}  | at each failure: {at_failure}"
        )


def _partitions(seconds: float) -> list[dict]:
    """The survivors' longest wait under a cut link (toy, single-rank groups on simulated hosts)."""
    from benchmarks import partition

    rows = []
    for scenario, survivors in (("lighthouse", (0, 1, 2)), ("group", (0, 1))):
        with tempfile.TemporaryDirectory() as work:
            r = partition.run_once(scenario, seconds, Path(work))
        wait = max(r[f"g{g}_gap_cut_s"] for g in survivors)
        rows.append({"scenario": f"partition_{scenario}", "survivors_longest_gap_s": wait, **r})
        print(
            f"toy      partition_{scenario:10} cut {seconds:.0f} s: survivors' longest gap {wait:.3f} s, "
            f"failures {r['failures']} (false {r['false_failures']}), heals {r['heals']}, "
            f"same state {r['final_states_equal']}",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
