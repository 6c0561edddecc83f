"""The fault matrix: every fault class against one group, several at once, and each job state,
in a few real jobs of the toy trainer (ftcore/examples/toy.py), one verdict per cell.

    python benchmarks/fault_matrix.py [--jobs groups3 groups5 lighthouse cuts3 cuts5] [--json PATH]
    python benchmarks/fault_matrix.py --fault-free 20     # no fault, beside a CPU hog: no verdict

Cells: {crash (kill -9), hang (SIGSTOP), link cut, slow} x {one group, two of three, three of
five}, and {lighthouse crash, pause, cut} x {every group in the quorum, one on standby, one
healing}. The launcher (`python -m training launch`) runs the crash, hang, slow and lighthouse
crash and pause cells, its fault plan firing them in turn by step and by the job's state
(ftcore/faults.py, `when`); link cuts run on simulated hosts (tests/netns.py, root only), a
host per group, this script cutting links and killing groups as a cluster would.

Per cell, from the fault to `span_s` after it:
- gap_s: the longest wait between two commits of a survivor (a group the fault did not touch);
- failed: the groups the lighthouse failed; false_failures: those that were not faulty;
- false_heals, false_exclusions: heals and exclusions of groups the cell does not touch;
- alone: commits by a faulty group, while its fault lasted, in a quorum no survivor committed in
  (a second history: cut off, it must commit nothing; a replacement that healed in may).
A cell passes with its gap under the heartbeat timeout (found by a probe or carried by the
lease, never waited out) and nothing false or alone; a job with equal final states and every
batch trained once (ftcore.ledger.check).
"""

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import netns  # noqa: E402

from benchmarks.launcher import launch, toy  # noqa: E402
from ftcore import ledger, timeouts  # noqa: E402
from ftcore.examples.toy import sample_ids  # noqa: E402
from ftcore.faults import LIGHTHOUSE_KINDS  # noqa: E402
from ftcore.util.files import atomic_write_json  # noqa: E402

STEP_SLEEP = 0.03  # the toy's step: about 45 ms with the exchange on this machine


@dataclass(frozen=True)
class Cell:
    """One fault episode of a job: its faults (plan entries; the first starts the episode) and
    what a correct verdict looks like."""

    case: str
    faults: tuple[dict, ...] = ()
    faulty: frozenset[int] = frozenset()  # groups the fault touches: they may fail, heal, be excluded
    survivors: frozenset[int] = frozenset()  # groups that must go on (their gaps are measured)
    lasts_s: float = 0.0  # how long the fault itself lasts (a hang, a pause, a cut)
    span_s: float = 8.0  # measured from its start


@dataclass(frozen=True)
class Job:
    name: str
    groups: int
    steps: int
    cells: tuple[Cell, ...]
    env: dict = field(default_factory=dict)
    on_hosts: bool = False  # link cuts: simulated hosts, driven by `run_on_hosts`
    step_sleep: float = STEP_SLEEP


# a group's faults wait for the job to be steady (the last cell over) and fire a step at a time
def _kill(g: int, step: int, inc: int) -> dict:
    return {"kind": "kill", "group": g, "at_step": step, "incarnation": inc, "when": "steady"}


def _stop(g: int, step: int, inc: int, s: float) -> dict:
    return {"kind": "stop", "group": g, "at_step": step, "incarnation": inc, "duration_s": s, "when": "steady"}


def _slow(g: int, step: int, until: int, inc: int = 0) -> dict:
    return {"kind": "slow", "group": g, "at_step": step, "until_step": until, "delay_s": 0.1, "incarnation": inc}


def _heal_slowly(step: int, inc: int = 0) -> dict:
    """Group 0 (the healer's source: the first trusted member) serves its next heal 0.5 s late."""
    return {"kind": "slow", "group": 0, "phase": "heal_serve", "at_step": step, "delay_s": 0.5, "incarnation": inc}


def _lighthouse(kind: str, step: int, s: float, when: str = "steady") -> dict:
    return {"kind": kind, "at_step": step, "duration_s": s, "when": when}


def _healing(case: str, kind: str, step: int, inc: int, s: float) -> Cell:
    """Group 2 killed and healing (from group 0, slowly) when the lighthouse fault fires."""
    faults = (_kill(2, step, inc), _heal_slowly(step), _lighthouse(kind, step, s, "healing"))
    return Cell(case, faults, frozenset({2}), frozenset({0, 1}), s, s + 6)


NONE: frozenset[int] = frozenset()
G3, G01 = frozenset({0, 1, 2}), frozenset({0, 1})
JOBS = {
    # slow cells first (in-process: they cannot wait for the job to be steady), a short probation
    "groups3": Job(
        "groups3",
        3,
        1200,
        (
            Cell("slow 2/3", (_slow(1, 30, 130), _slow(2, 30, 130)), frozenset({1, 2}), frozenset({0}), 0, 12),
            Cell("crash 1/3", (_kill(2, 200, 0),), frozenset({2}), frozenset({0, 1})),
            Cell("crash 2/3", (_kill(1, 300, 0), _kill(2, 300, 1)), frozenset({1, 2}), frozenset({0})),
            Cell("hang 1/3, 5 s", (_stop(2, 400, 2, 5),), frozenset({2}), frozenset({0, 1}), 5, 12),
            Cell("hang 2/3, 5 s", (_stop(1, 500, 1, 5), _stop(2, 500, 2, 5)), frozenset({1, 2}), frozenset({0}), 5, 12),
            # replaced after --replace-after (15 s) unhealthy: they rejoin as new incarnations
            Cell(
                "hang 2/3, 30 s",
                (_stop(1, 600, 1, 30), _stop(2, 600, 2, 30)),
                frozenset({1, 2}),
                frozenset({0}),
                30,
                36,
            ),
        ),
        env={"FTCORE_SLOW_PROBATION": "5"},
    ),
    "groups5": Job(
        "groups5",
        5,
        750,  # its last cell's heals end near step 640 here (about 1,110 with the make-up at 900)
        (
            Cell("slow 3/5", tuple(_slow(g, 30, 130) for g in (2, 3, 4)), frozenset({2, 3, 4}), G01, 0, 12),
            Cell("crash 3/5", tuple(_kill(g, 200, 0) for g in (2, 3, 4)), frozenset({2, 3, 4}), frozenset({0, 1})),
            Cell(
                "hang 3/5, 5 s",
                tuple(_stop(g, 320, 1, 5) for g in (2, 3, 4)),
                frozenset({2, 3, 4}),
                frozenset({0, 1}),
                5,
                12,
            ),
        ),
        # its hang may land while a heal's next quorum builds its group (the rendezvous probes too)
        env={"FTCORE_SLOW_PROBATION": "5"},
    ),
    # a lease trains on through a pause: slower steps (fewer of them a pause), and small at_step
    # bounds (the cells wait for a steady job, in order)
    "lighthouse": Job(
        "lighthouse",
        3,
        900,  # its last cell ends near step 700 here (at most 10 steps/s); group 2's make-up comes after
        (
            Cell("lighthouse pause 5 s, all in quorum", (_lighthouse("pause_lighthouse", 40, 5),), NONE, G3, 5, 10),
            Cell("lighthouse crash, all in quorum", (_lighthouse("kill_lighthouse", 50, 1.5),), NONE, G3, 1.5, 8),
            _healing("lighthouse pause 5 s, one healing", "pause_lighthouse", 60, 0, 5),
            _healing("lighthouse pause 20 s, one healing", "pause_lighthouse", 70, 1, 20),
            _healing("lighthouse crash, one healing", "kill_lighthouse", 80, 2, 1.5),
            # group 2's fourth incarnation is slow from its first step: excluded, on standby
            Cell("slow 1/3", (_slow(2, 0, 2000, 3),), frozenset({2}), G01, 0, 12),
            Cell(
                "lighthouse pause 5 s, one on standby",
                (_lighthouse("pause_lighthouse", 90, 5, "standby"),),
                frozenset({2}),
                G01,
                5,
                10,
            ),
            Cell(
                "lighthouse pause 20 s, one on standby",
                (_lighthouse("pause_lighthouse", 100, 20, "standby"),),
                frozenset({2}),
                G01,
                20,
                25,
            ),
            Cell(
                "lighthouse crash, one on standby",
                (_lighthouse("kill_lighthouse", 110, 1.5, "standby"),),
                frozenset({2}),
                G01,
                1.5,
                8,
            ),
        ),
        # on standby for the three cells that need it, not readmitted between them
        env={"FTCORE_SLOW_PROBATION": "90"},
        step_sleep=0.1,
    ),
    # on simulated hosts: `faults` unused; the groups cut (or killed) are `faulty`, and
    # run_on_hosts does each cell's case by its name. The lighthouse's own cuts share the job
    # (one start of hosts and groups); the standby cell last (its group stays excluded).
    "cuts3": Job(
        "cuts3",
        3,
        1800,
        (
            Cell("link cut 1/3, 5 s", (), frozenset({2}), frozenset({0, 1}), 5, 12),
            Cell("link cut 2/3, 5 s", (), frozenset({1, 2}), frozenset({0}), 5, 12),
            Cell("lighthouse cut 5 s, all in quorum", (), frozenset(), G3, 5, 10),
            Cell("lighthouse cut 5 s, one healing", (), frozenset({2}), frozenset({0, 1}), 5, 12),
            Cell("lighthouse cut 5 s, one on standby", (), frozenset({1}), frozenset({0, 2}), 5, 10),
        ),
        on_hosts=True,
    ),
    "cuts5": Job(
        "cuts5",
        5,
        500,
        (Cell("link cut 3/5, 5 s", (), frozenset({2, 3, 4}), frozenset({0, 1}), 5, 12),),
        on_hosts=True,
    ),
}


# ---- verdicts ----------------------------------------------------------------------------------
@dataclass
class Seen:
    """What one job left: commits per group (time, quorum id), the lighthouse's events, and
    when each cell started."""

    commits: dict[int, list[tuple[float, int]]]
    events: list[dict]
    starts: list[float]
    states_equal: bool
    ledger_ok: str  # "" or the ledger check's error


def verdict(cell: Cell, start: float, end: float, seen: Seen) -> dict:
    """One cell's row (see the module's docstring), from its start to `end`."""
    gap = 0.0
    quorums = set()  # the quorums a survivor committed in
    for g in cell.survivors:
        mine = [t for t, _ in seen.commits.get(g, [])]
        before = [t for t in mine if t <= start][-1:]  # its last commit before the fault ...
        after = [end] if any(t > end for t in mine) else []  # ... and a wait that runs past the window
        ts = before + [t for t in mine if start < t <= end] + after
        gap = max([gap, *(b - a for a, b in itertools.pairwise(ts))])
        quorums |= {q for _, q in seen.commits.get(g, [])}
    during = [e for e in seen.events if start <= e["t"] <= end]
    failed = sorted({e["group"] for e in during if e["kind"] == "failure_detected"})
    healed = {e["group"] for e in during if e["kind"] == "heal_assigned"}
    excluded = {e["group"] for e in during if e["kind"] == "group_excluded"}
    lasts = start + cell.lasts_s
    alone = sum(1 for g in cell.faulty for t, q in seen.commits.get(g, []) if start < t < lasts and q not in quorums)
    row = {
        "case": cell.case,
        "gap_s": round(gap, 3),
        "failed": failed,
        "false_failures": sorted(set(failed) - cell.faulty),
        "false_heals": sorted(healed - cell.faulty),
        "false_exclusions": sorted(excluded - cell.faulty),
        "alone": alone,
    }
    row["ok"] = gap < timeouts.HEARTBEAT_TIMEOUT and not (
        row["false_failures"] or row["false_heals"] or row["false_exclusions"] or row["alone"]
    )
    return row


def rows(job: Job, seen: Seen) -> list[dict]:
    ends = [*seen.starts[1:], float("inf")]  # a cell is measured until the next one starts
    out = [
        {"job": job.name, **verdict(c, s, min(s + c.span_s, e), seen)}
        for c, s, e in zip(job.cells, seen.starts, ends, strict=True)
    ]
    for r in out:
        r["states_equal"], r["ledger"] = seen.states_equal, seen.ledger_ok or "exactly once"
        r["ok"] = r["ok"] and seen.states_equal and not seen.ledger_ok
    return out


def check_ledger(out: Path, job: Job) -> str:
    try:
        ledger.check(
            str(out / "ledger"),
            steps_per_epoch=job.steps,
            num_groups=job.groups,
            ranks_per_group=1,
            epochs=1,
            sample_ids=lambda s, rg: sample_ids(s, rg, job.steps, 16),
        )
    except ledger.LedgerError as e:
        return str(e)
    return ""


# ---- jobs under the launcher -------------------------------------------------------------------
def _starts(job: Job, tl: dict) -> list[float]:
    """When each cell started: its first fault's launcher event (the first after the previous
    cell's), or for a slow fault the first commit of that group at or past its step."""
    starts, after = [], 0.0
    fired = [e for e in tl["launcher_events"] if e["kind"] == "fault"]
    for c in job.cells:
        f = c.faults[0]
        if f["kind"] == "slow":
            mine = [s for s in tl["steps"] if s["group"] == f["group"] and s["incarnation"] == f["incarnation"]]
            t = min(s["t"] for s in mine if s["step"] >= f["at_step"] and s["t"] > after)
        else:
            lh = f["kind"] in LIGHTHOUSE_KINDS
            match = [
                e for e in fired if e["fault"] == f["kind"] and e["t"] > after and (lh or e.get("group") == f["group"])
            ]
            if not match:
                raise RuntimeError(f"{job.name}: the fault of {c.case!r} never fired ({f})")
            t = match[0]["t"]
        starts.append(t)
        after = t
    return starts


def run_launched(job: Job, work: Path) -> list[dict]:
    out = work / "run"
    faults = [f for c in job.cells for f in c.faults]
    tl = launch(str(out), faults, toy(job.steps, job.step_sleep), groups=job.groups, env=job.env, timeout=400)
    commits: dict[int, list[tuple[float, int]]] = {}
    for s in tl["steps"]:
        if s["committed"]:
            commits.setdefault(s["group"], []).append((s["t"], s["quorum_id"]))
    commits = {g: sorted(c) for g, c in commits.items()}  # the timeline lists each incarnation's in turn
    states = {(out / f"replica_{g}" / "state.safetensors").read_bytes() for g in range(job.groups)}
    seen = Seen(commits, tl["lighthouse_events"], _starts(job, tl), len(states) == 1, check_ledger(out, job))
    return rows(job, seen)


# ---- jobs on simulated hosts -------------------------------------------------------------------
class Hosted:
    """A lighthouse on host "lh" and each group of the toy on a host of its own ("g0", ...)."""

    def __init__(self, hosts: netns.Hosts, job: Job, work: Path, plans: dict[int, list[dict]]):
        self.hosts, self.job, self.out, self.logs = hosts, job, work / "run", work / "logs"
        self.out.mkdir()
        self.logs.mkdir()
        token = work / "token"
        token.write_text("fault-matrix-secret")
        token.chmod(0o600)
        lighthouse = f"{hosts.addr['lh']}:29510"
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FTCORE_LIGHTHOUSE": lighthouse}
        self.env |= {"FTCORE_TOKEN_FILE": str(token), "FTCORE_JOB_ID": job.name}
        self.env |= {"FTREC_NUM_REPLICA_GROUPS": str(job.groups), "FTCORE_SLOW_PROBATION": "90"}
        self.env.pop("FTCORE_HOST", None)
        argv = [sys.executable, "-m", "ftcore.lighthouse", "--bind", lighthouse, "--token-file", str(token)]
        hosts.start("lh", [*argv, "--events-file", str(self.out / "events.jsonl")], self.env, self.logs / "lh.log")
        self.procs = {g: self.start(g, plans.get(g)) for g in range(job.groups)}

    def start(self, g: int, plan: list[dict] | None = None) -> subprocess.Popen:
        argv = [sys.executable, "-m", "ftcore.examples.toy", "--out", str(self.out), "--steps", str(self.job.steps)]
        env = {**self.env, "FTREC_REPLICA_GROUP": str(g)}
        if plan:  # its incarnation 0: the plan's (a restarted group takes its clock's, larger)
            (self.out.parent / f"plan-{g}.json").write_text(json.dumps(plan))
            env |= {"FTCORE_FAULTS": str(self.out.parent / f"plan-{g}.json"), "FTCORE_INCARNATION": "0"}
        argv += ["--step-sleep", str(self.job.step_sleep)]
        return self.hosts.start(f"g{g}", argv, env, self.logs / f"g{g}.log")

    def events(self) -> list[dict]:
        path = self.out / "events.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    def commits(self, g: int) -> list[tuple[float, int]]:
        recs = [
            json.loads(line)
            for f in sorted((self.out / "records").glob(f"group-{g}-rank-0-inc-*.jsonl"))
            for line in f.read_text().splitlines()
            if line.strip()
        ]
        return sorted((r["t"], r["quorum_id"]) for r in recs if r["committed"])

    def wait(self, what: str, ok, limit: float = 120.0) -> None:
        deadline = time.monotonic() + limit
        while not ok():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.job.name}: waited {limit:.0f} s for {what}: {self.tail()}")
            time.sleep(0.05)

    def tail(self) -> str:
        return " | ".join(f"{p.name}: {p.read_text()[-300:]}" for p in sorted(self.logs.glob("*.log")))

    def settle(self, groups: frozenset[int], seconds: float = 3.0) -> None:
        """These groups commit again, then a little more (the last cell's heals are done)."""
        marks = {g: len(self.commits(g)) for g in groups}
        self.wait("the groups to commit", lambda: all(len(self.commits(g)) > marks[g] + 20 for g in marks))
        time.sleep(seconds)

    def cut(self, names: list[str], seconds: float) -> float:
        t = time.time()
        for n in names:
            self.hosts.cut(n)
        time.sleep(seconds)
        for n in names:
            self.hosts.cut(n, off=False)
        return t

    def finish(self, starts: list[float]) -> Seen:
        exits = [p.wait(timeout=300) for p in self.procs.values()]
        sums = set()
        for log in self.logs.glob("g*.log"):
            sums |= {ln.split("checksum ")[1].split()[0] for ln in log.read_text().splitlines() if " checksum " in ln}
        commits = {g: self.commits(g) for g in range(self.job.groups)}
        ok = len(sums) == 1 and exits == [0] * self.job.groups
        return Seen(commits, self.events(), starts, ok, check_ledger(self.out, self.job))


def _duty_until_excluded(h: Hosted, g: int, limit: float = 60.0) -> None:
    """Group g's process stopped 0.25 s of every 0.5 s (a throttled host) until it is excluded."""
    deadline = time.monotonic() + limit
    pid = h.procs[g].pid
    while not any(e["kind"] == "group_excluded" and e["group"] == g for e in h.events()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{h.job.name}: group {g} was never excluded: {h.tail()}")
        os.killpg(pid, signal.SIGSTOP)
        time.sleep(0.25)
        os.killpg(pid, signal.SIGCONT)
        time.sleep(0.25)


def _drive(h: Hosted, cell: Cell) -> float:
    """Do one cell on simulated hosts; its start."""
    groups = [f"g{g}" for g in sorted(cell.faulty)]
    if cell.case.startswith("link cut"):
        return h.cut(groups, cell.lasts_s)
    if cell.case.endswith("one healing"):  # killed and restarted: cut while it heals (slowly)
        t = time.time()
        os.killpg(h.procs[2].pid, signal.SIGKILL)
        h.procs[2].wait(timeout=30)
        h.procs[2] = h.start(2)
        h.wait("a heal", lambda: any(e["kind"] == "heal_assigned" and e["t"] > t for e in h.events()))
        h.cut(["lh"], cell.lasts_s)
        return t
    if cell.case.endswith("one on standby"):
        _duty_until_excluded(h, 1)
        return h.cut(["lh"], cell.lasts_s)
    return h.cut(["lh"], cell.lasts_s)  # all in quorum


def run_on_hosts(job: Job, work: Path) -> list[dict]:
    names = ["lh", *(f"g{g}" for g in range(job.groups))]
    with netns.Hosts(names) as hosts:
        heals = any(c.case.endswith("one healing") for c in job.cells)
        # group 0 serves every heal slowly (one fault a heal): the cells before make heals too
        h = Hosted(hosts, job, work, {0: [_heal_slowly(0)] * 8} if heals else {})
        h.wait("the first steps", lambda: all(len(h.commits(g)) >= 30 for g in range(job.groups)))
        starts = []
        for cell in job.cells:
            starts.append(_drive(h, cell))
            h.settle(cell.survivors)
        seen = h.finish(starts)
    return rows(job, seen)


def run(name: str, keep: str | None = None) -> list[dict]:
    """One job's rows; `keep`: a folder to leave its outputs in (a temporary one otherwise)."""
    job = JOBS[name]
    with tempfile.TemporaryDirectory() as d:
        work = Path(keep) / name if keep else Path(d)
        work.mkdir(parents=True, exist_ok=True)
        return (run_on_hosts if job.on_hosts else run_launched)(job, work)


def fault_free(runs: int, steps: int = 300) -> dict:
    """`runs` jobs of 3 groups with no fault, each beside a CPU hog (a busy loop on one of the
    two cores): every exclusion or failure the lighthouse declares is a false verdict."""
    from benchmarks.hog import hog

    verdicts = {"runs": runs, "exclusions": 0, "failures": 0, "equal_states": 0}
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as d, hog(procs=1):
            tl = launch(str(Path(d) / "run"), [], toy(steps, STEP_SLEEP), groups=3, timeout=300)
            kinds = [e["kind"] for e in tl["lighthouse_events"]]
            verdicts["exclusions"] += kinds.count("group_excluded")
            verdicts["failures"] += kinds.count("failure_detected")
            sums = {(Path(d) / "run" / f"replica_{g}" / "state.safetensors").read_bytes() for g in range(3)}
            verdicts["equal_states"] += len(sums) == 1
        print(json.dumps(verdicts), flush=True)
    return verdicts


COLUMNS = ("job", "case", "gap_s", "failed", "false_failures", "false_heals", "false_exclusions", "alone", "ok")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=list(JOBS))
    p.add_argument("--json", default=str(ROOT / "bench-results" / "fault_matrix.json"))
    p.add_argument("--keep", help="leave each job's outputs under this folder")
    p.add_argument("--fault-free", type=int, default=0, metavar="RUNS", help="RUNS jobs with no fault beside a hog")
    a = p.parse_args()
    if a.fault_free:
        v = fault_free(a.fault_free)
        atomic_write_json(a.json, {"fault_free": v}, indent=1)
        return 0 if v["exclusions"] == v["failures"] == 0 and v["equal_states"] == v["runs"] else 1
    why = netns.unavailable()
    out = []
    for name in a.jobs:
        if JOBS[name].on_hosts and why:
            print(f"{name}: skipped: {why}")
            continue
        out += run(name, a.keep)
        print(json.dumps(out[-1]), flush=True)
    print("\n| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for r in out:
        print("| " + " | ".join(str(r[c]) for c in COLUMNS) + " |")
    atomic_write_json(a.json, {"rows": out}, indent=1)
    return 0 if all(r["ok"] for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
