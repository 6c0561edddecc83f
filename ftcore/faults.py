"""Fault plans: what to break, where and when; one JSON or TOML format for tests, benchmarks,
the launcher and the Airflow chaos DAG. Kinds: kill, stop, raise, slow, kill_lighthouse,
pause_lighthouse; each fires once, on the group's first incarnation unless `incarnation` says
otherwise; an external one may wait for a state of the job too (`when`: steady, a group on
standby, a group healing). The format with examples: docs/ftcore.md, "faults"."""

import json
import os
import signal
import time
import tomllib
from dataclasses import dataclass, field

KINDS = ("kill", "stop", "raise", "kill_lighthouse", "pause_lighthouse", "slow")
LIGHTHOUSE_KINDS = ("kill_lighthouse", "pause_lighthouse")
PHASES = ("before_allreduce", "during_allreduce", "after_allreduce", "vote", "heal_serve")
# states of the job an external fault can wait for (launcher/watch.py). steady: every group
# healthy and in the quorum, nobody healing or on standby (the last fault is over)
WHEN = ("steady", "standby", "healing")


class PlanError(ValueError):
    """The fault plan file is wrong; the message names the file, the fault and the key."""


class InjectedFault(RuntimeError):
    """Raised by a `raise` fault."""


@dataclass
class Fault:
    kind: str
    group: int = 0
    rank: int | str = 0
    at_step: int | None = None
    at_time: float | None = None
    phase: str | None = None
    duration_s: float = 0.0
    until_step: int | None = None
    delay_s: float = 0.0
    incarnation: int = 0
    when: str | None = None  # also wait until the job is in this state (WHEN)
    fired: bool = field(default=False, compare=False)

    def targets(self, group: int, rank: int, incarnation: int) -> bool:
        return (
            self.group == group and self.incarnation == incarnation and (self.rank == "all" or int(self.rank) == rank)
        )

    @property
    def in_process(self) -> bool:
        return self.kind in ("raise", "slow") or (self.kind == "kill" and self.phase is not None)

    def due(self, step: int, elapsed: float, states: set[str]) -> bool:
        """An external fault's trigger: its step or time reached (`step`: its group's, or the
        job's for a lighthouse fault; `elapsed`: seconds since the launch), and its state seen."""
        if self.when is not None and self.when not in states:
            return False
        if self.at_step is None and self.at_time is None:
            return True
        return (self.at_time is not None and elapsed >= self.at_time) or (
            self.at_step is not None and step >= self.at_step
        )


# What each key must hold: a plan is read once, so `group = "1"` (a fault that would never
# fire) or `at_step = "5"` (a crash inside the rank at run time) is refused here instead.
_COUNTS = ("group", "at_step", "until_step", "incarnation")
_SECONDS = ("at_time", "duration_s", "delay_s")


def _type_problem(key: str, value) -> str | None:
    if key in ("kind", "phase", "when"):
        return None if isinstance(value, str) else "must be a string"
    if key == "rank":
        return None if value == "all" or (type(value) is int and value >= 0) else 'must be a rank >= 0 or "all"'
    if key in _COUNTS:
        return None if type(value) is int and value >= 0 else "must be a whole number >= 0"
    if key in _SECONDS:
        ok = type(value) in (int, float) and value >= 0 and value == value and value != float("inf")
        return None if ok else "must be a number of seconds >= 0"
    return None


def load(path: str) -> list[Fault]:
    """Read and check a plan; raises PlanError with a one-line message."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise PlanError(f"fault plan {path}: {e.strerror}") from None
    try:
        doc = tomllib.loads(raw.decode()) if path.endswith(".toml") else json.loads(raw)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"fault plan {path}: not valid {'TOML' if path.endswith('.toml') else 'JSON'}: {e}") from None
    return parse(doc, path)


def parse(doc: dict | list, where: str = "fault plan") -> list[Fault]:
    items = doc.get("faults", []) if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise PlanError(f"{where}: 'faults' must be a list of tables")
    known = set(Fault.__dataclass_fields__) - {"fired"}
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise PlanError(f"{where}: fault #{i + 1} is not a table")
        unknown = set(item) - known
        if unknown:
            raise PlanError(f"{where}: fault #{i + 1} has unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
        for key, value in item.items():
            problem = _type_problem(key, value)
            if problem:
                raise PlanError(f"{where}: fault #{i + 1}: {key} = {value!r} {problem}")
        try:
            f = Fault(**item)
        except TypeError as e:
            raise PlanError(f"{where}: fault #{i + 1}: {e}") from None
        if f.until_step is not None and f.at_step is not None and f.until_step <= f.at_step:
            raise PlanError(f"{where}: fault #{i + 1}: until_step {f.until_step} must be after at_step {f.at_step}")
        if f.kind not in KINDS:
            raise PlanError(f"{where}: fault #{i + 1}: kind {f.kind!r} is not one of {KINDS}")
        if f.phase is not None and f.phase not in PHASES:
            raise PlanError(f"{where}: fault #{i + 1}: phase {f.phase!r} is not one of {PHASES}")
        if f.kind == "raise" and f.phase is None:
            raise PlanError(f"{where}: fault #{i + 1}: a 'raise' fault needs a phase, one of {PHASES}")
        if f.at_step is not None and f.at_time is not None:
            raise PlanError(f"{where}: fault #{i + 1}: give at most one of at_step or at_time")
        if f.at_step is None and f.at_time is None and f.when is None and f.kind != "slow":
            raise PlanError(f"{where}: fault #{i + 1}: give one of at_step or at_time (or when)")
        if f.when is not None and (f.when not in WHEN or f.in_process):
            raise PlanError(f"{where}: fault #{i + 1}: when {f.when!r} is not one of {WHEN} (external faults only)")
        if f.kind == "slow" and f.at_step is None:
            raise PlanError(f"{where}: fault #{i + 1}: a 'slow' fault needs at_step (and until_step)")
        out.append(f)
    return out


class Injector:
    """The in-process faults of one rank: called by the manager at each phase."""

    def __init__(self, faults: list[Fault], group: int, rank: int, incarnation: int):
        self.faults = [f for f in faults if f.in_process and f.targets(group, rank, incarnation)]
        self.start = time.monotonic()

    def _due(self, f: Fault, step: int) -> bool:
        if f.at_step is not None:
            return step >= f.at_step
        return time.monotonic() - self.start >= (f.at_time or 0.0)

    def phase(self, phase: str, step: int) -> None:
        for f in self.faults:
            if f.fired or f.phase != phase or not self._due(f, step):
                continue
            f.fired = True
            if f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if f.kind == "slow":  # e.g. a heal source that serves slowly: a heal that lasts
                time.sleep(f.delay_s)
                return  # one fault a call: the next due one slows the next
            raise InjectedFault(f"injected fault: raise in {phase} at step {step}")

    def slow(self, step: int) -> None:
        for f in self.faults:
            until = f.until_step if f.until_step is not None else 1 << 62
            if f.kind == "slow" and f.phase is None and f.at_step is not None and f.at_step <= step < until:
                time.sleep(f.delay_s)
