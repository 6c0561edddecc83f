"""Partitions on simulated hosts: what a link that goes dark (no socket closes) costs the job.

    python benchmarks/partition.py [--runs 3] [--seconds 8] [--scenario lighthouse group]
        [--load quiet hog] [--json PATH]

Four network namespaces on one switch (tests/netns.py): the lighthouse on host a, three
single-rank replica groups of the toy trainer (ftcore/examples/toy.py, 30 ms steps) on b, c, d.
Mid-run one host's switch port goes down for `--seconds`, then comes back:

- `lighthouse`: host a. Goal: no failure event, no heal, longest gap between commits <= 0.25 s.
- `group`: host d (group 2). Reported: the survivors' longest gap between commits (goal:
  <= heartbeat timeout + one step; their stalled exchange asks the lighthouse after
  FTCORE_STALL_PROBE, which fails group 2 when it is not heard within the failure probe), and
  whether group 2 rejoined by heal with equal states.
- `source`: as `group`, and group 0, the peer group 2 heals from when it returns, is killed
  (SIGKILL) while it serves that heal, then started again on its host, as a scheduler would.
  Group 1 should never notice: the healing group and its source stand aside from its exchange
  (ftcore/messages.py, Quorum.aside), so none of its exchanges fails or re-runs.

Per run: failure and heal events, each group's longest commit gap that began while the link
was down and after it came back, committed / leased / failed step attempts, equal final
states, the survivors' p99 commit gap, and false failures: a `failure_detected` for a group the
scenario did not cut or kill, or before it did (any: the run exits 1). Each run quiet and beside
a CPU hog (benchmarks/hog.py), interleaved. Needs root and iproute2 (as the tests do).
"""

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import netns  # noqa: E402

from benchmarks import hog, verdicts  # noqa: E402
from ftcore.util.files import atomic_write_json  # noqa: E402

STEPS = 400
CUT = {"lighthouse": "a", "group": "d", "source": "d"}
FAULTED = {"lighthouse": (), "group": (2,), "source": (2, 0)}  # the groups each scenario cuts or kills
SURVIVORS = {"lighthouse": (0, 1, 2), "group": (0, 1), "source": (1,)}


def _records(out: Path, g: int) -> list[dict]:
    return [
        json.loads(line)
        for f in sorted((out / "records").glob(f"group-{g}-rank-0-inc-*.jsonl"))
        for line in f.read_text().splitlines()
        if line.strip()
    ]


def run_once(scenario: str, seconds: float, work: Path) -> dict:
    out, logs = work / "run", work / "logs"
    out.mkdir()
    logs.mkdir()
    token = work / "token"
    token.write_text("partition-bench-secret")
    token.chmod(0o600)
    with netns.Hosts(["a", "b", "c", "d"]) as hosts:
        lighthouse = f"{hosts.addr['a']}:29510"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FTCORE_LIGHTHOUSE": lighthouse}
        env |= {"FTCORE_TOKEN_FILE": str(token), "FTCORE_JOB_ID": "partition", "FTREC_NUM_REPLICA_GROUPS": "3"}
        env.pop("FTCORE_HOST", None)
        lh = [sys.executable, "-m", "ftcore.lighthouse", "--bind", lighthouse, "--token-file", str(token)]
        hosts.start("a", [*lh, "--events-file", str(out / "events.jsonl")], env, logs / "a.log")
        toy = [sys.executable, "-m", "ftcore.examples.toy", "--out", str(out), "--steps", str(STEPS)]
        toy += ["--step-sleep", "0.03"]
        envs = [{**env, "FTREC_REPLICA_GROUP": str(g)} for g in range(3)]
        if scenario == "source":  # group 0 dies as it serves its first heal
            plan = work / "faults.json"
            plan.write_text(json.dumps([{"kind": "kill", "group": 0, "phase": "heal_serve", "at_step": 0}]))
            envs[0] = {**envs[0], "FTCORE_FAULTS": str(plan), "FTCORE_INCARNATION": "0"}  # the plan's
        procs = [hosts.start(h, toy, envs[g], logs / f"{h}.log") for g, h in enumerate("bcd")]
        deadline = time.monotonic() + 180
        while not all(len(_records(out, g)) >= 30 for g in range(3)):
            if time.monotonic() > deadline:
                raise SystemExit(f"the groups did not start: {(logs / 'b.log').read_text()[-1000:]}")
            time.sleep(0.1)
        t_cut = time.time()
        hosts.cut(CUT[scenario])
        time.sleep(seconds)
        hosts.cut(CUT[scenario], off=False)
        t_up = time.time()
        codes = []
        if scenario == "source":  # the scheduler starts the killed group again, without the fault
            codes.append(procs[0].wait(timeout=120))
            envs[0] = {k: v for k, v in envs[0].items() if k not in ("FTCORE_FAULTS", "FTCORE_INCARNATION")}
            procs[0] = hosts.start("b", toy, envs[0], logs / "b-restarted.log")
        codes += [p.wait(timeout=300) for p in procs]
    return _row(scenario, seconds, work, codes, (t_cut, t_up))


def _row(scenario: str, seconds: float, work: Path, codes: list, cut: tuple[float, float]) -> dict:
    """A run's figures from its events, logs and records; `cut`: when the link went down, came up."""
    out, logs = work / "run", work / "logs"
    t_cut, t_up = cut
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    sums = set()
    for log in logs.glob("[bcd]*.log"):
        sums |= {ln.split("checksum ")[1].split()[0] for ln in log.read_text().splitlines() if " checksum " in ln}
    row: dict = {"scenario": scenario, "cut_s": seconds, "exit_codes": codes, "final_states_equal": len(sums) == 1}
    row["isolations"] = sum(e["kind"] == "lighthouse_isolated" for e in events)
    row["failures"] = sum(e["kind"] == "failure_detected" for e in events)
    row["stall_reports"] = sum(e["kind"] == "stall_reported" for e in events)  # by an exchange ...
    row["round_probes"] = sum(e["kind"] == "round_stalled" for e in events)  # ... or by a round kept waiting
    row["heals"] = sum(e["kind"] == "heal_assigned" for e in events)
    wrong = verdicts.false_failures(events, {g: [t_cut] for g in FAULTED[scenario]}, within_s=seconds + 60)
    row["false_failures"] = len(wrong)
    row["false_failure_reasons"] = sorted({str(e.get("reason")) for e in wrong})
    row["survivors_gap_p99_s"] = _gap_p99(out, SURVIVORS[scenario], t_cut - 1)
    for g in range(3):
        recs = _records(out, g)
        ts = [r["t"] for r in recs if r["committed"] and r["t"] >= t_cut - 1]
        gaps = [(a, b - a) for a, b in itertools.pairwise(ts)]
        # the longest gap that began while the link was down, and one that began after it came back
        row[f"g{g}_gap_cut_s"] = round(max((d for a, d in gaps if a < t_up), default=0.0), 3)
        row[f"g{g}_gap_after_s"] = round(max((d for a, d in gaps if a >= t_up), default=0.0), 3)
        row[f"g{g}_committed"] = sum(r["committed"] for r in recs)
        row[f"g{g}_leased"] = sum(r["committed"] and r["leased"] for r in recs)
        row[f"g{g}_failed_attempts"] = sum(not r["committed"] and not r.get("idle") for r in recs)
        # exchanges re-run after a peer failed them, from when the link came back
        row[f"g{g}_reran_after"] = sum(r["requorum"] for r in recs if r["t"] >= t_up)
        row[f"g{g}_failed_after"] = sum(not r["committed"] and not r.get("idle") for r in recs if r["t"] >= t_up)
    return row


def _gap_p99(out: Path, groups: tuple[int, ...], since: float) -> float:
    """The p99 of these groups' gaps between commits from `since` (the cut's span included)."""
    gaps = []
    for g in groups:
        ts = [r["t"] for r in _records(out, g) if r["committed"] and r["t"] >= since]
        gaps += [b - a for a, b in itertools.pairwise(ts)]
    gaps.sort()
    return round(gaps[int(0.99 * (len(gaps) - 1))], 3) if gaps else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0, help="how long the link stays down")
    p.add_argument("--scenario", nargs="+", choices=sorted(CUT), default=["lighthouse", "group"])
    p.add_argument("--load", nargs="+", choices=hog.LOADS, default=list(hog.LOADS), help="quiet, beside a CPU hog")
    p.add_argument("--json", default=str(ROOT / "bench-results" / "partition.json"))
    a = p.parse_args()
    why = netns.unavailable()
    if why:
        print(f"partition: skipped: {why}")
        return 0
    rows = []
    for i in range(a.runs):
        for scenario, load in itertools.product(a.scenario, a.load):  # interleaved: the noise falls on all alike
            with tempfile.TemporaryDirectory() as d, hog.load(load):
                rows.append({"run": i, "load": load, **run_once(scenario, a.seconds, Path(d))})
            print(json.dumps(rows[-1]), flush=True)
    cols = list(rows[0])
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    atomic_write_json(a.json, {"rows": rows}, indent=1)
    wrong = sum(r["false_failures"] for r in rows)
    print(f"\nfalse failures: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
