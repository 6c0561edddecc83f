"""One slow replica group in a real job: the job's commit rate with the fail-slow policy off and on.

    python benchmarks/fail_slow.py [--reps 2] [--json PATH]                      # a slow group
    python benchmarks/fail_slow.py --scenario duty [--seconds 30] [--reps 1]     # a duty-cycled rank

The launcher runs the toy trainer (ftcore/examples/toy.py), 3 replica groups, steps of ~35 ms.

`--scenario sleep` (default): 300 steps; a fault plan makes group 2 sleep --delay seconds in each
of its steps 20..200 (a group several times slower than its peers, as a throttled GPU or a noisy
host is). Modes, interleaved, --reps times each:

- off:   FTCORE_SLOW_RATIO=0, every step waits for the slow group (before this policy);
- on:    the defaults (ftcore/pace.py): excluded at R/(R-1) x 1.1 over FTCORE_SLOW_WINDOW rounds,
         held on standby, readmitted through a heal after its probation or when the data is done;
- clean: the policy on and nobody slowed: it must exclude nobody (false positives).

Reported: group 0's commits per second from its step 30 to its step 200 (the slow
stretch), the job's wall time (launcher start to end, make-up included: the data stays
exactly once, so the excluded group's batches are trained after, by every live group), exclusions, heals, and
whether all groups ended with the same state.

`--scenario duty`: rank --rank of group 2 (of --ranks-per-group) is SIGSTOPped 0.25 s and
SIGCONTed 0.25 s (50% duty) for --seconds (default 8; the issue's figure is 30), from --before
seconds after the first quorum; modes off and on (probation --probation, default --seconds).
Reported: group 0's committed steps/s before, during and after (after: from the slow group's
heal back in, or the slowdown's end, for --after seconds of regular steps), the pace during as
a ratio of the unimpeded one (steps, and batches: a step carries one per contributing group)
and of (R-1)/R, when group 2 was excluded and which rank the lighthouse named, exclusions of
anyone else, whether and when it rejoined by heal after the slowdown, the job's wall time.
"""

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
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


# ---- the duty-cycled rank ------------------------------------------------------------
DUTY_MODES = {"off": {"FTCORE_SLOW_RATIO": "0"}, "on": {}}
STOP_S = 0.25  # SIGSTOP this long, then SIGCONT for as long: 50% duty


class Live:
    """The launcher's output, read as it comes: the target rank's pid and the first quorum."""

    def __init__(self, p: subprocess.Popen, group: int, rank: int):
        self.p, self.group, self.rank = p, group, rank
        self.lines: list[str] = []
        self.pid: int | None = None
        self.started = threading.Event()  # the first quorum formed: training runs
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line)
            if line.startswith("[launch] group_started "):
                ev = json.loads(line.split(" ", 2)[2])
                if ev["group"] == self.group and ev["incarnation"] == 0:
                    self.pid = ev["pids"][self.rank]
            elif line.startswith("[lighthouse] ") and '"quorum_formed"' in line:
                self.started.set()
        self.started.set()  # ended before training ran: the caller sees the exit code


def duty_cycle(pid: int, seconds: float) -> tuple[float, float]:
    """SIGSTOP `pid` for STOP_S, SIGCONT it for STOP_S, for `seconds`; (start, end) epoch times.
    Ends early if the process is gone; never leaves it stopped."""
    t0 = time.time()
    try:
        while time.time() - t0 < seconds:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(STOP_S)
            os.kill(pid, signal.SIGCONT)
            time.sleep(STOP_S)
    except ProcessLookupError:
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return t0, time.time()


def launch_duty(out: str, a: argparse.Namespace, env: dict[str, str]) -> tuple[dict, tuple[float, float]]:
    """One launcher run in its own session: rank a.rank of group 2 at 50% duty for a.seconds,
    from a.before seconds after the first quorum. (timeline, (duty start, duty end))."""
    steps = a.steps or int(a.pace * (a.before + a.seconds + 15))
    worker_options, worker_args = toy(steps, 0.03)
    args = [sys.executable, "-m", "training", "launch", "--replica-groups", "3", "--out", out, "--timeout"]
    args += [str(a.timeout), "--ranks-per-group", str(a.ranks_per_group), *worker_options, "--", *worker_args]
    t_start = time.monotonic()
    p = subprocess.Popen(
        args,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    live = Live(p, 2, a.rank)
    try:
        live.started.wait(120)
        time.sleep(a.before)
        if live.pid is None or p.poll() is not None:
            raise RuntimeError("the launcher ended or never started group 2:\n" + "".join(live.lines[-40:]))
        duty = duty_cycle(live.pid, a.seconds)
        p.wait(timeout=a.timeout + 60)  # the launcher's own --timeout ends its groups first
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)  # the launcher and every group it started
        p.wait()
        raise
    live.reader.join(10)
    if p.returncode != 0:
        raise RuntimeError(f"launcher failed ({p.returncode}):\n" + "".join(live.lines[-40:]))
    tl = json.loads(Path(out, "timeline.json").read_text())
    tl["wall_s"] = time.monotonic() - t_start
    return tl, duty


def rate(commits: list[tuple[float, int]], t0: float, t1: float) -> tuple[float, float]:
    """(steps/s, batches/s) of group 0's commits in [t0, t1): a step carries one batch per contributor."""
    inside = [c for t, c in commits if t0 <= t < t1]
    span = t1 - t0
    return (len(inside) / span, sum(inside) / span) if span > 0.5 else (math.nan, math.nan)


def duty_phases(tl: dict, duty: tuple[float, float], after_s: float, groups: int = 3) -> dict:
    """Pace before, during and after the slowdown, and what the lighthouse did about it."""
    commits = sorted(
        (s["t"], s["contributors"]) for s in tl["steps"] if s["committed"] and s["group"] == 0 and s["rank"] == 0
    )
    ev = tl["lighthouse_events"]
    excl = [e for e in ev if e["kind"] == "group_excluded"]
    slow = [e for e in excl if e["group"] == 2 and e["t"] >= duty[0]]
    back = [e for e in ev if e["kind"] == "group_readmitted" and e["group"] == 2 and e["t"] >= duty[0]]
    heal = [
        e
        for e in ev
        if e["kind"] == "heal_assigned" and e["group"] == 2 and back and e["t"] >= back[0]["t"] and e["t"] >= duty[1]
    ]
    full = [t for t, c in commits if c == groups]  # the make-up phase (fewer contributors) is not "after"
    after0 = max(duty[1], heal[0]["t"]) if heal else duty[1]
    after1 = min(after0 + after_s, full[-1] if full else after0)
    before, during, after = (
        rate(commits, commits[0][0] + 1.0, duty[0]),
        rate(commits, *duty),
        rate(commits, after0, after1),
    )
    keep = (groups - 1) / groups
    return {
        "steps_per_s": [round(x[0], 2) for x in (before, during, after)],
        "during_steps_vs_unimpeded": round(during[0] / before[0], 3),
        "during_batches_vs_unimpeded": round(during[1] / before[1], 3),
        "during_batches_vs_(R-1)/R": round(during[1] / before[1] / keep, 3),
        "after_steps_vs_unimpeded": round(after[0] / before[0], 3),
        "excluded_after_s": round(slow[0]["t"] - duty[0], 2) if slow else None,
        "rank_named": slow[0].get("rank") if slow else None,
        "rank_busy_s": [slow[0].get("rank_busy_s"), slow[0].get("other_ranks_busy_s")] if slow else None,
        "exclusions": len(slow),
        "false_exclusions": len(excl) - len(slow),
        "rejoined_by_heal_after_s": round(heal[0]["t"] - duty[1], 2) if heal else None,
    }


def run_duty(mode: str, a: argparse.Namespace) -> dict:
    env = {"FTCORE_SLOW_PROBATION": str(a.probation or a.seconds), **DUTY_MODES[mode]}
    with tempfile.TemporaryDirectory() as d:
        try:
            tl, duty = launch_duty(os.path.join(d, "run"), a, env)
        except RuntimeError as e:
            raise RuntimeError(f"{mode}: {e}") from None
    row = {"mode": mode, **duty_phases(tl, duty, a.after)}
    row["job_wall_s"] = round(tl["wall_s"], 1)
    row["identical"] = len(set(tl["checksums"].values())) == 1
    return row


def table(rows: list[dict]) -> None:
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


def sleep_scenario(a: argparse.Namespace) -> dict:
    rows = [run(m, a.delay) for _ in range(a.reps) for m in MODES]
    table(rows)
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
    return {"rows": rows, "median": med}


def duty_scenario(a: argparse.Namespace) -> dict:
    rows = [run_duty(m, a) for _ in range(a.reps) for m in DUTY_MODES]
    table(rows)
    keys = ("during_steps_vs_unimpeded", "during_batches_vs_(R-1)/R", "job_wall_s")
    med = {m: {k: statistics.median(r[k] for r in rows if r["mode"] == m) for k in keys} for m in DUTY_MODES}
    on = [r for r in rows if r["mode"] == "on"]
    print(
        f"\nwhile rank {a.rank} of group 2 ran at 50% duty for {a.seconds:g}s (medians): committed steps/s "
        f"on {med['on'][keys[0]]:.2f} / off {med['off'][keys[0]]:.2f} of the unimpeded pace; batches/s "
        f"on {med['on'][keys[1]]:.2f} / off {med['off'][keys[1]]:.2f} of (R-1)/R of it (goal >= 0.9); "
        f"job wall time on/off {med['on']['job_wall_s'] / med['off']['job_wall_s']:.2f}; "
        f"on: excluded in {sum(r['excluded_after_s'] is not None for r in on)}/{len(on)} runs, "
        f"rejoined by heal in {sum(r['rejoined_by_heal_after_s'] is not None for r in on)}/{len(on)}"
    )
    return {"rows": rows, "median": med, "args": vars(a)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=("sleep", "duty"), default="sleep")
    p.add_argument("--reps", type=int, default=None, help="runs of each mode (default: sleep 2, duty 1)")
    p.add_argument("--delay", type=float, default=0.1, help="sleep: seconds the slow group sleeps per step")
    p.add_argument("--seconds", type=float, default=8.0, help="duty: how long the rank runs at 50%% duty")
    p.add_argument("--before", type=float, default=3.0, help="duty: seconds of unimpeded steps first")
    p.add_argument("--after", type=float, default=4.0, help="duty: seconds measured after it rejoined")
    p.add_argument("--probation", type=float, default=None, help="duty: FTCORE_SLOW_PROBATION (default --seconds)")
    p.add_argument("--ranks-per-group", type=int, default=1)
    p.add_argument("--rank", type=int, default=None, help="duty: the rank slowed (default the group's last)")
    p.add_argument("--pace", type=float, default=30.0, help="duty: steps/s to size the run (more: more steps)")
    p.add_argument("--steps", type=int, default=0, help="duty: steps of the run (default from --pace)")
    p.add_argument("--timeout", type=float, default=600.0, help="duty: seconds one run may take")
    p.add_argument("--json", default=None, help="default bench-results/fail_slow[_duty].json")
    a = p.parse_args()
    a.reps = a.reps or (2 if a.scenario == "sleep" else 1)
    a.rank = a.ranks_per_group - 1 if a.rank is None else a.rank
    if not 0 <= a.rank < a.ranks_per_group or a.seconds <= 0:
        p.error("--rank must be below --ranks-per-group, --seconds > 0")
    out = sleep_scenario(a) if a.scenario == "sleep" else duty_scenario(a)
    name = "fail_slow" if a.scenario == "sleep" else "fail_slow_duty"
    path = Path(a.json or ROOT / "bench-results" / f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
