"""The launcher's watch: external faults fired on time, a dead lighthouse restarted, hung groups
replaced (unhealthy on the lighthouse for --replace-after seconds while their processes live)."""

import itertools
import signal
import threading
import time
from typing import Any, Protocol

from ftcore.faults import LIGHTHOUSE_KINDS, Fault
from ftcore.launcher.config import LaunchConfig
from ftcore.launcher.host import LighthouseHost
from ftcore.launcher.procs import Proc


class Watched(Protocol):
    """What the watch reads of the launch it watches, and the three things it may do to it:
    log, restart the lighthouse, and (through a group's first Proc) mark a group for replacement."""

    cfg: LaunchConfig
    stop: threading.Event
    t0: float
    host: LighthouseHost
    groups: dict[int, list[Proc]]
    incarnation: dict[int, int]
    done: set[int]

    def status(self) -> dict | None: ...
    def log(self, msg: str, **data: Any) -> None: ...
    def start_lighthouse(self) -> None: ...


def states(status: dict, groups: int) -> set[str]:
    """The job's states a fault can wait for (faults.WHEN), from the lighthouse's status."""
    out = set()
    quorum, seen = status.get("quorum") or {}, status.get("groups", [])
    if any(gr.get("standby_s") is not None for gr in seen):
        out.add("standby")
    if quorum.get("heal"):
        out.add("healing")
    healthy = {gr["group"] for gr in seen if gr["healthy"] and not gr["left"]}
    if not out and len(healthy) == groups and set(quorum.get("groups", ())) == healthy:
        out.add("steady")
    return out


EPISODE_GAP_S = 2.0  # after a fault that lasts (and waited for a state), before the next such fault


class Watch:
    """Polls the lighthouse every 20 ms while the launch runs."""

    def __init__(self, launcher: Watched, faults: list[Fault]):
        self.launcher = launcher
        self.faults = faults
        self.unhealthy_since: dict[int, float] = {}
        self.armed = True  # a fault waiting for a steady job may fire (the last one's effect was seen)
        self.quiet_until = 0.0  # monotonic: the next batch waiting for a state fires after this

    def run(self) -> None:
        la = self.launcher
        while not la.stop.wait(0.02):
            st = la.status()
            now = time.monotonic()
            if la.host.died():
                assert la.host.proc is not None  # died() says so
                la.log("lighthouse_died", code=la.host.proc.p.returncode)
                la.start_lighthouse()
                continue
            steps = {gr["group"]: gr["step"] for gr in (st or {}).get("groups", [])}
            now_in = states(st or {}, la.cfg.replica_groups)
            self.armed = self.armed or "steady" not in now_in
            for f in self.due(steps, now - la.t0, now_in):
                self.armed = self.armed and f.when is None
                if f.when is not None and f.duration_s > 0:  # a fault that lasts is over before the next
                    self.quiet_until = max(self.quiet_until, now + f.duration_s + EPISODE_GAP_S)
                f.fired = True
                threading.Thread(target=self.fire, args=(f,), daemon=True).start()
            if st:
                self.hangs(st["groups"], now)

    def due(self, steps: dict[int, int], elapsed: float, now_in: set[str]) -> list[Fault]:
        """The external faults whose step or time has come (a lighthouse fault's step is the
        job's, any other fault's its group's, in the incarnation it names). Faults that wait for
        a state of the job (`when`) go in plan order, one batch at a time (the faults after it
        with the same trigger: one episode); a batch waiting for a steady job fires only once
        the job was seen unsteady since the last batch (its effect seen), however far the
        steps ran meanwhile."""
        out = [f for f in self.faults if f.when is None and not f.fired and self._ready(f, steps, elapsed, now_in)]
        queue = [f for f in self.faults if f.when is not None and not f.fired and not f.in_process]
        if queue and (queue[0].when != "steady" or self.armed) and time.monotonic() >= self.quiet_until:
            head = queue[0]
            batch = itertools.takewhile(
                lambda f: (f.when, f.at_step, f.at_time) == (head.when, head.at_step, head.at_time), queue
            )
            out += [f for f in batch if self._ready(f, steps, elapsed, now_in)]
        return out

    def _ready(self, f: Fault, steps: dict[int, int], elapsed: float, now_in: set[str]) -> bool:
        if f.in_process:
            return False
        on_lighthouse = f.kind in LIGHTHOUSE_KINDS
        if not on_lighthouse and self.launcher.incarnation.get(f.group) != f.incarnation:
            return False
        step = max(steps.values(), default=0) if on_lighthouse else steps.get(f.group, -1)
        return f.due(step, elapsed, now_in)

    def hangs(self, groups: list[dict], now: float) -> None:
        """Mark a group for replacement once it has been unhealthy while alive for too long."""
        la = self.launcher
        for gr in groups:
            g = gr["group"]
            alive = g in la.groups and all(p.p.poll() is None for p in la.groups[g]) and g not in la.done
            if alive and not gr["healthy"] and not gr["left"] and gr["incarnation"] == la.incarnation.get(g):
                self.unhealthy_since.setdefault(g, now)
                if now - self.unhealthy_since[g] > la.cfg.replace_after:
                    la.groups[g][0].replace_group = True
                    self.unhealthy_since.pop(g)
            else:
                self.unhealthy_since.pop(g, None)

    def fire(self, f: Fault) -> None:
        la = self.launcher
        lh = la.host.proc
        if f.kind in LIGHTHOUSE_KINDS and lh is None:
            la.log("fault_skipped", fault=f.kind, reason="the lighthouse was not started here")
            return
        if f.kind == "pause_lighthouse" and lh is not None:
            la.log("fault", fault="pause_lighthouse", pid=lh.pid, seconds=f.duration_s)
            lh.signal(signal.SIGSTOP)
            time.sleep(f.duration_s)
            lh.signal(signal.SIGCONT)
            la.log("fault_resumed", fault="pause_lighthouse")
            return
        if f.kind == "kill_lighthouse" and lh is not None:
            lh.planned_kill = True
            la.log("fault", fault="kill_lighthouse", pid=lh.pid)
            lh.kill()
            time.sleep(f.duration_s)
            la.start_lighthouse()
            la.log("lighthouse_restarted")
            return
        self.signal_ranks(f)

    def signal_ranks(self, f: Fault) -> None:
        """kill: SIGKILL; stop: SIGSTOP, and SIGCONT after its duration."""
        la = self.launcher
        procs = la.groups.get(f.group, [])
        targets = procs if f.rank == "all" else procs[int(f.rank) : int(f.rank) + 1]
        sig = signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP
        for p in targets:
            la.log("fault", fault=f.kind, group=f.group, rank=f.rank, pid=p.pid)
            p.signal(sig)
        if f.kind == "stop" and f.duration_s > 0:
            time.sleep(f.duration_s)
            for p in targets:
                p.signal(signal.SIGCONT)
            la.log("fault_resumed", fault="stop", group=f.group)
