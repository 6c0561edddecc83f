"""The lighthouse: FT-HSDP's control plane, a standing service for every job of a cluster.
It creates a job on its first message and retires it once it finished or all its ranks have
been gone for `job_idle_s`, keeps one credential per job, and notices its own pauses; nothing
that matters is lost with a restart (groups re-register, their quorum is handed out again).
The CLI and the service's rules: docs/ftcore.md, "lighthouse"."""

import argparse
import collections
import json
import resource
import sys
import threading
import time
from typing import Any

from ftcore import auth, netaddr, settings
from ftcore.lighthouse_config import LighthouseConfig
from ftcore.lighthouse_http import LighthouseServer
from ftcore.lighthouse_job import TICK_S, Job
from ftcore.lighthouse_pulse import Pulse
from ftcore.messages import DEFAULT_JOB, ClientEvent, FailureReport, RankInfo

PACE_S = 1.0  # how often the heartbeat pace is set from the speakers counted
RETIRED_KEPT = 256  # retired jobs listed by GET /jobs, whose final status GET /status still shows
RETIRED_EVENTS = 50  # ... with this many of their last events


class Lighthouse:
    """The control plane of every job that reports to it (one `Job` each, by job id)."""

    def __init__(self, cfg: LighthouseConfig):
        self.cfg = cfg
        self._jobs_lock = threading.Lock()
        self.jobs: dict[str, Job] = {}
        self.retired: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._events_lock = threading.Lock()
        self.events: collections.deque = collections.deque(maxlen=200)  # the lighthouse's own (no job)
        self.started = time.time()
        self._events_file = open(cfg.events_file, "a") if cfg.events_file else None
        self._stop = threading.Event()
        self.pulse = Pulse(cfg, self.event)  # its own pauses and pace, shared by every job
        self._ticker = threading.Thread(target=self._tick, daemon=True, name="lighthouse-tick")
        self._ticker.start()
        self.event("lighthouse_started", lighthouse_id=self.pulse.lighthouse_id, min_replicas=cfg.min_replicas)

    def event(self, kind: str, **data: Any) -> None:
        """Log an event: to stdout and the events file always, in memory with its job (or the
        lighthouse's own list when it has none)."""
        ev = {"t": time.time(), "kind": kind, **data}
        line = json.dumps(ev)
        job = self.jobs.get(data["job"]) if "job" in data else None
        with self._events_lock:
            (job.events if job is not None else self.events).append(ev)
            print(line, flush=True)
            if self._events_file:
                self._events_file.write(line + "\n")
                self._events_file.flush()

    def job(self, info: RankInfo) -> Job:
        """The job a rank belongs to, created by its first message (a checked one: a bad
        message creates no job)."""
        with self._jobs_lock:
            j = self.jobs.get(info.job)
            if j is None:
                if len(self.jobs) >= self.cfg.max_jobs:
                    live = ", ".join(sorted(self.jobs)[:10])
                    raise ValueError(
                        f"this lighthouse serves {len(self.jobs)} live jobs, its limit (--max-jobs); "
                        f"live: {live}{' ...' if len(self.jobs) > 10 else ''}; jobs retire when they finish "
                        f"or after {self.cfg.job_idle_s:g}s without a rank (--job-idle)"
                    )
                j = self.jobs[info.job] = Job(
                    self.cfg, self.pulse, self.event, info.job, info.num_groups, info.min_replicas
                )
                gone = self.retired.get(info.job)
                if gone is not None and time.monotonic() < gone["remember_until"]:
                    j.finished_step = gone["finished_step"]  # a late group of a finished job is told so
            return j

    def _retire(self, j: Job, reason: str) -> None:
        """Free a job's state (called by the ticker, under the job's lock)."""
        with self._jobs_lock:
            if self.jobs.get(j.name) is not j:
                return
            self.event("job_retired", job=j.name, reason=reason, max_step=j.max_step, finished_step=j.finished_step)
            del self.jobs[j.name]
            self.retired.pop(j.name, None)
            self.retired[j.name] = {
                "job": j.name,
                "reason": reason,
                "retired_at": time.time(),
                "max_step": j.max_step,
                "finished_step": j.finished_step,
                "remember_until": time.monotonic() + self.cfg.finished_linger_s if j.finished_step else 0.0,
                "final": {**snapshot(j), "events": list(j.events)[-RETIRED_EVENTS:]},  # what GET /status shows
            }
            while len(self.retired) > RETIRED_KEPT:
                self.retired.popitem(last=False)

    def _tick(self) -> None:
        paced = 0.0
        while not self._stop.wait(TICK_S):
            self.pulse.notice_pause(time.monotonic())
            count = time.monotonic() - paced >= PACE_S
            speakers = 0
            for j in list(self.jobs.values()):
                try:
                    with j.lock:
                        now = time.monotonic()
                        # its speakers (a relay for its group, or each rank): the heartbeats it sends
                        speakers += sum(g.registered for g in j.groups.values() if not g.left) if count else 0
                        j.tick(now)
                        why = j.retirement(now, self.cfg.job_idle_s)
                        if why:
                            self._retire(j, why)
                except Exception as e:  # never let one job's bad state end every job's rounds
                    self.event("tick_error", job=j.name, error=f"{type(e).__name__}: {e}"[:300])
            if count:
                self.pulse.pace(speakers)
                paced = time.monotonic()

    # ---- messages for a job that may not exist (never created by them) ----------------------
    def report_failure(self, report: FailureReport) -> None:
        j = self.jobs.get(report.job)
        if j is not None:
            j.report_failure(report)

    def leave(self, info: RankInfo) -> None:
        j = self.jobs.get(info.job)
        if j is not None:
            j.leave(info)

    def client_event(self, ev: ClientEvent) -> None:
        if ev.job in self.jobs:  # a job's ranks speak of their own job: no events for jobs that are not
            self.event(ev.kind, **ev.data, job=ev.job)

    def status(self, job: str = DEFAULT_JOB, everyone: bool = True) -> dict[str, Any]:
        """One job's status; `everyone`: the caller may see which other jobs exist (admin)."""
        j, gone = self.jobs.get(job), self.retired.get(job)
        if j is not None:
            with j.lock:
                st = snapshot(j)
            with self._events_lock:
                st["events"] = list(j.events)[-100:]
        elif gone is not None:  # its final state, and why and when it retired
            st = {**gone["final"], "retired": {"reason": gone["reason"], "retired_at": gone["retired_at"]}}
        else:
            st = {"job": job, "min_replicas": self.cfg.min_replicas, "max_step": 0, "quorum": None, "groups": []}
            st["events"] = []
        return {
            "lighthouse_id": self.pulse.lighthouse_id,
            "uptime_s": time.time() - self.started,
            "jobs": sorted(self.jobs) if everyone else [job] if j is not None else [],
            **st,
        }

    def jobs_report(self) -> dict[str, Any]:
        """GET /jobs (admin): live jobs in brief, and the most recently retired."""
        live = []
        for j in list(self.jobs.values()):
            with j.lock:
                live.append(summary(j, time.monotonic()))
        hidden = ("remember_until", "final")
        retired = [{k: v for k, v in r.items() if k not in hidden} for r in reversed(self.retired.values())]
        return {"live": sorted(live, key=lambda r: r["job"]), "retired": retired[:200], "max_jobs": self.cfg.max_jobs}

    def close(self) -> None:
        self._stop.set()


def summary(j: Job, now: float) -> dict[str, Any]:
    """One line of GET /jobs (under the job's lock)."""
    return {
        "job": j.name,
        "groups": len(j.groups),
        "healthy": len(j.health.healthy),
        "ranks": sum(g.world if g.relay else g.registered for g in j.groups.values()),
        "quorum_id": j.quorum.quorum_id if j.quorum else 0,
        "max_step": j.max_step,
        "finished_step": j.finished_step,
        "idle_s": round(now - j.last_heard, 3),
    }


def snapshot(j: Job) -> dict[str, Any]:
    """GET /status's view of a job (under the job's lock)."""
    now = time.monotonic()
    return {
        "job": j.name,
        "min_replicas": j.min_replicas,
        "max_step": j.max_step,
        "quorum": j.quorum.shared() if j.quorum else None,
        "groups": [
            {
                "group": g.group,
                "incarnation": g.incarnation,
                "healthy": g.healthy,
                "left": g.left,
                "step": g.step,
                "ranks": g.world if g.relay and g.registered else g.registered,
                "world": g.world,
                "relay": g.relay,
                "standby_s": round(max(j.slow.excluded[g.group] - now, 0.0), 2) if g.group in j.slow.excluded else None,
                "last_beat_age_s": now - g.last_beat() if g.registered else None,
            }
            for g in sorted(j.groups.values(), key=lambda g: g.group)
        ],
    }


def serve(cfg: LighthouseConfig) -> tuple[LighthouseServer, Lighthouse]:
    """Start a lighthouse server in background threads; returns (server, lighthouse)."""
    host, _, port = cfg.bind.rpartition(":")
    _raise_fd_limit()
    lh = Lighthouse(cfg)
    try:
        server = LighthouseServer(lh, host.strip("[]") or "127.0.0.1", int(port))
    except OSError:
        lh.close()
        raise
    lh.pulse.read_until = server.read_until
    return server, lh


def _raise_fd_limit() -> None:
    """Every rank holds two connections: take the hard limit of file descriptors, not the soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _arg_parser() -> argparse.ArgumentParser:
    """The command line: LighthouseConfig's table, and where the admin secret comes from."""
    p = argparse.ArgumentParser(prog="python -m ftcore.lighthouse", description=__doc__.split("\n\n")[0])
    settings.add_arguments(p, LighthouseConfig)
    p.add_argument(
        "--token-file",
        help="file holding the admin secret (else FTCORE_TOKEN / FTCORE_TOKEN_FILE); each job's "
        "token derives from it: python -m ftcore.auth job-token JOB",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve without a token (loopback binds only): anyone who reaches it can steer every job",
    )
    return p


def _config(a: argparse.Namespace) -> LighthouseConfig:
    """The service's configuration from its command line; ValueError says what to fix."""
    token = auth.read_token_file(a.token_file) if a.token_file else auth.token_from_env()
    if token is None and not a.insecure:
        raise ValueError(
            "no token; give --token-file, or set FTCORE_TOKEN / FTCORE_TOKEN_FILE "
            "(or --insecure on a loopback --bind for a throwaway run)"
        )
    if token is None and not netaddr.is_loopback(a.bind.rpartition(":")[0].strip("[]") or "127.0.0.1"):
        raise ValueError(
            f"refusing to serve {a.bind} without a token: --insecure is for loopback binds only; give --token-file"
        )
    cfg = settings.from_args(LighthouseConfig, vars(a), token=token)
    settings.check(cfg)
    cfg.pace.check()
    return cfg


def main(argv: list[str] | None = None) -> int:
    a = _arg_parser().parse_args(argv)
    try:
        cfg = _config(a)
    except ValueError as e:
        print(f"ftcore.lighthouse: {e}", file=sys.stderr)
        return 2
    try:
        server, lh = serve(cfg)
    except OSError as e:
        print(f"ftcore.lighthouse: cannot listen on {a.bind}: {e.strerror}; choose another --bind", file=sys.stderr)
        return 2
    print(
        json.dumps({"t": time.time(), "kind": "listening", "address": "{}:{}".format(*server.server_address[:2])}),
        flush=True,
    )
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
