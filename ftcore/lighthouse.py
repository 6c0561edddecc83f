"""The lighthouse: FT-HSDP's control plane (membership, quorum, heal assignments, events).

Every rank of every replica group registers, heartbeats, and asks for a quorum once
per step. A quorum round answers all ranks of all participating groups at once with
the same `quorum_id` (the membership epoch: it grows whenever the set of participating
group incarnations changes), the highest committed step, and which groups must heal
from which up-to-date group. A failed group is noticed three ways:

- its heartbeat connection closes (a killed process: milliseconds),
- a survivor reports a data-plane error and the group does not heartbeat within
  FAILURE_PROBE (a crash the kernel did not announce),
- its heartbeats stop for HEARTBEAT_TIMEOUT (a hang, SIGSTOP).

A fast quorum forms as soon as every healthy member of the previous quorum asks (a
failed member is not waited for; a new group joins at the next round); otherwise the
round waits up to JOIN_TIMEOUT for stragglers. Every quorum needs min_replicas groups
and a majority of the healthy groups (no split brain). Stdlib HTTP + JSON; every request
needs the shared token when one is configured. The lighthouse keeps no state that
matters across its own restart: groups re-register on their next heartbeat, their
steps come with them, and the quorum id resumes above the largest one they report.

    python -m ftcore.lighthouse --bind 127.0.0.1:PORT --min-replicas N
"""

import argparse
import collections
import html
import json
import secrets
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ftcore import auth, timeouts


@dataclass
class LighthouseConfig:
    bind: str = "127.0.0.1:0"
    min_replicas: int = 1
    expected_replicas: int = 0     # groups the job starts with: the first quorum waits for them (or the join timeout)
    join_timeout: float = timeouts.JOIN_TIMEOUT
    heartbeat_timeout: float = timeouts.HEARTBEAT_TIMEOUT
    failure_probe: float = timeouts.FAILURE_PROBE
    token: str | None = None
    events_file: str | None = None


@dataclass
class Rank:
    rank: int
    store: str = ""        # host:port of this rank's TCPStore (rendezvous for cross-group groups)
    heal: str = ""         # host:port of this rank's heal server
    step: int = 0          # committed steps
    last_beat: float = 0.0
    disconnected: bool = False


@dataclass
class Group:
    group: int
    incarnation: int
    world: int             # ranks per group (K)
    ranks: dict[int, Rank] = field(default_factory=dict)
    healthy: bool = False
    left: bool = False
    leaving: bool = False  # a rank said goodbye: the group is ending cleanly, rank by rank

    @property
    def step(self) -> int:
        return min((r.step for r in self.ranks.values()), default=0)


@dataclass
class Request:
    req_id: str
    group: int
    rank: int
    incarnation: int
    step: int
    t: float          # monotonic time of arrival
    last_quorum: int  # the last quorum id this rank trained in


class StaleIncarnation(Exception):
    """A message from a process of a group incarnation that has been replaced."""


class Lighthouse:
    def __init__(self, cfg: LighthouseConfig):
        self.cfg = cfg
        self.epoch = secrets.token_hex(4)  # distinguishes store prefixes across lighthouse restarts
        self.lock = threading.Condition()
        self.groups: dict[int, Group] = {}
        self.quorum: dict[str, Any] | None = None
        self.quorum_id = 0
        self.max_step = 0
        self.pending: dict[int, dict[int, Request]] = {}
        self.results: dict[str, dict[str, Any]] = {}
        self._last_wait_event = 0.0
        self.force_new = False  # a data-plane failure: the next quorum gets a new id, whoever is in it
        self.reports: dict[int, float] = {}  # quorum_id -> time of the first data-plane failure report
        self.events: collections.deque = collections.deque(maxlen=2000)
        self.started = time.time()
        self._events_file = open(cfg.events_file, "a") if cfg.events_file else None
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True, name="lighthouse-tick")
        self._ticker.start()
        self.event("lighthouse_started", epoch=self.epoch, min_replicas=cfg.min_replicas)

    # ---- events -------------------------------------------------------------------
    def event(self, kind: str, **data: Any) -> None:
        ev = {"t": time.time(), "kind": kind, **data}
        self.events.append(ev)
        line = json.dumps(ev)
        print(line, flush=True)
        if self._events_file:
            self._events_file.write(line + "\n")
            self._events_file.flush()

    # ---- membership ---------------------------------------------------------------
    def _rank(self, msg: dict[str, Any]) -> tuple[Group, Rank]:
        """Find or register the sender of `msg` (group, rank, world, incarnation, ...)."""
        g, r, inc = int(msg["group"]), int(msg["rank"]), int(msg.get("incarnation", 0))
        grp = self.groups.get(g)
        if grp is not None and inc < grp.incarnation:
            raise StaleIncarnation(f"group {g} incarnation {inc} was replaced by {grp.incarnation}")
        if grp is None or inc > grp.incarnation:
            if grp is not None:
                self._drop_pending(g)
            grp = self.groups[g] = Group(g, inc, int(msg.get("world", 1)))
            self.event("register", group=g, incarnation=inc, world=grp.world, step=int(msg.get("step", 0)))
        rk = grp.ranks.get(r)
        if rk is None:
            rk = grp.ranks[r] = Rank(r)
        grp.left = False
        rk.store = msg.get("store", rk.store)
        rk.heal = msg.get("heal", rk.heal)
        rk.step = max(rk.step, int(msg.get("step", rk.step)))  # a late heartbeat may carry an older step
        rk.last_beat = time.monotonic()
        rk.disconnected = False
        self.max_step = max(self.max_step, rk.step)
        # After a lighthouse restart, quorum ids resume above any a member has seen.
        self.quorum_id = max(self.quorum_id, int(msg.get("quorum_id", 0)))
        return grp, rk

    def _drop_pending(self, g: int) -> None:
        for req in self.pending.pop(g, {}).values():
            self.results[req.req_id] = {"error": "stale incarnation"}

    def _is_healthy(self, grp: Group, now: float) -> bool:
        if grp.left or len(grp.ranks) < grp.world:
            return False
        report = self.reports.get(self.quorum["quorum_id"]) if self.quorum else None
        in_quorum = self.quorum is not None and grp.group in self.quorum["groups"]
        for rk in grp.ranks.values():
            if rk.disconnected or now - rk.last_beat > self.cfg.heartbeat_timeout:
                return False
            if report is not None and in_quorum and rk.last_beat < report and now > report + self.cfg.failure_probe:
                return False
        return True

    def _update_health(self, now: float) -> None:
        for grp in self.groups.values():
            ok = self._is_healthy(grp, now)
            if ok != grp.healthy:
                grp.healthy = ok
                if ok:
                    self.event("group_healthy", group=grp.group, incarnation=grp.incarnation, step=grp.step)
                elif not (grp.left or grp.leaving):
                    why = ("connection closed" if any(r.disconnected for r in grp.ranks.values())
                           else "heartbeat timeout")
                    self.event("failure_detected", group=grp.group, incarnation=grp.incarnation, reason=why)

    # ---- quorum ---------------------------------------------------------------------
    def _maybe_form(self, now: float) -> None:
        self._update_health(now)
        if not self.pending:
            return
        healthy = {g for g, grp in self.groups.items() if grp.healthy}
        requesting = sorted(
            g for g, reqs in self.pending.items()
            if g in healthy and len(reqs) == self.groups[g].world
        )
        round_start = min((req.t for reqs in self.pending.values() for req in reqs.values()), default=now)
        if self.quorum:
            fast = (set(self.quorum["groups"]) & healthy) <= set(requesting)
        else:  # first quorum (or first after a lighthouse restart): wait for the whole job
            fast = healthy <= set(requesting) and len(requesting) >= self.cfg.expected_replicas
        waited = now - round_start >= self.cfg.join_timeout
        enough = len(requesting) >= self.cfg.min_replicas and 2 * len(requesting) > len(healthy)
        if requesting and enough and (fast or waited):
            self._form(requesting)
        elif now - round_start > 1.0 and now - self._last_wait_event > 1.0:
            self._last_wait_event = now  # say why a round is stuck (status page, timeline)
            self.event("quorum_waiting", requesting=requesting, healthy=sorted(healthy),
                       pending={str(g): sorted(r) for g, r in self.pending.items()},
                       previous=self.quorum["groups"] if self.quorum else None, seconds=round(now - round_start, 2))

    def _form(self, members: list[int]) -> None:
        identity = [[g, self.groups[g].incarnation] for g in members]
        if self.quorum is None or self.quorum["identity"] != identity or self.force_new:
            self.quorum_id += 1
        self.force_new = False
        steps = {g: min(req.step for req in self.pending[g].values()) for g in members}
        # Only members of the previous quorum may serve state. A group that was left out
        # (hung, cut off) may have committed a step the others discarded: it heals even
        # at an equal step. After a lighthouse restart, trust the latest reported quorum.
        if self.quorum is not None:
            before = {(g, inc) for g, inc in self.quorum["identity"]}
            trusted = [g for g in members if (g, self.groups[g].incarnation) in before]
        else:
            last = {g: min(req.last_quorum for req in self.pending[g].values()) for g in members}
            trusted = [g for g in members if last[g] == max(last.values())]
        trusted = trusted or members
        max_step = max(steps[g] for g in trusted)
        sources = [g for g in trusted if steps[g] == max_step]
        healers = [g for g in members if g not in sources]
        heal = {str(g): sources[i % len(sources)] for i, g in enumerate(healers)}  # spread over sources
        q = {
            "quorum_id": self.quorum_id,
            "epoch": self.epoch,
            "identity": identity,
            "groups": members,
            "max_step": max_step,
            "heal": heal,
            "members": {
                str(g): {
                    "step": steps[g],
                    "incarnation": self.groups[g].incarnation,
                    "store": [self.groups[g].ranks[r].store for r in range(self.groups[g].world)],
                    "heal": [self.groups[g].ranks[r].heal for r in range(self.groups[g].world)],
                }
                for g in members
            },
        }
        changed = self.quorum is None or self.quorum["quorum_id"] != self.quorum_id
        self.quorum = q
        self.max_step = max(self.max_step, max_step)
        if changed:
            self.event("quorum_formed", quorum_id=self.quorum_id, groups=members, max_step=max_step, heal=heal)
        for g in healers:
            self.event("heal_assigned", group=g, source=heal[str(g)], step=max_step, quorum_id=self.quorum_id)
        for g in members:
            for req in self.pending.pop(g).values():
                self.results[req.req_id] = q
        self.lock.notify_all()

    def request_quorum(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.lock:
            grp, _ = self._rank(msg)
            req = Request(secrets.token_hex(8), grp.group, int(msg["rank"]), grp.incarnation,
                          int(msg.get("step", 0)), time.monotonic(), int(msg.get("quorum_id", 0)))
            self.pending.setdefault(grp.group, {})[req.rank] = req
            while req.req_id not in self.results:
                now = time.monotonic()
                self._maybe_form(now)
                if req.req_id in self.results:
                    break
                if now >= deadline:
                    if self.pending.get(grp.group, {}).get(req.rank) is req:
                        del self.pending[grp.group][req.rank]
                        if not self.pending[grp.group]:
                            del self.pending[grp.group]
                    return {"error": "timeout waiting for a quorum"}
                self.lock.wait(min(0.01, deadline - now))
            return self.results.pop(req.req_id)

    def _tick(self) -> None:
        while not self._stop.wait(0.01):
            with self.lock:
                self._maybe_form(time.monotonic())

    # ---- other requests -------------------------------------------------------------
    def heartbeat(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self._rank(msg)
            failed = []
            if self.quorum:
                now = time.monotonic()
                failed = [g for g in self.quorum["groups"]
                          if g in self.groups and not self._is_healthy(self.groups[g], now)]
            return {"quorum_id": self.quorum["quorum_id"] if self.quorum else 0, "failed": failed}

    def disconnected(self, g: int, r: int, inc: int) -> None:
        with self.lock:
            grp = self.groups.get(g)
            if grp is not None and grp.incarnation == inc and r in grp.ranks and not grp.left:
                grp.ranks[r].disconnected = True
                self._maybe_form(time.monotonic())

    def report_failure(self, msg: dict[str, Any]) -> None:
        with self.lock:
            qid = int(msg.get("quorum_id", 0))
            self.event("failure_reported", group=msg.get("group"), rank=msg.get("rank"), quorum_id=qid,
                       error=str(msg.get("error", ""))[:200])
            self.reports.setdefault(qid, time.monotonic())
            if self.quorum is not None and qid == self.quorum["quorum_id"]:
                self.force_new = True  # the reporter's process group is broken: rebuild everyone's

    def leave(self, msg: dict[str, Any]) -> None:
        with self.lock:
            grp = self.groups.get(int(msg["group"]))
            if grp is None or grp.incarnation != int(msg.get("incarnation", 0)):
                return
            grp.ranks.pop(int(msg["rank"]), None)
            grp.leaving = True   # its other ranks leave next: not a failure
            if not grp.ranks and not grp.left:
                grp.left = True
                grp.healthy = False
                self.event("group_left", group=grp.group, incarnation=grp.incarnation)

    def client_event(self, msg: dict[str, Any]) -> None:
        with self.lock:
            kind = str(msg.pop("kind", "event"))
            self.event(kind, **{k: v for k, v in msg.items() if isinstance(v, (int, float, str, list))})

    def status(self) -> dict[str, Any]:
        with self.lock:
            now = time.monotonic()
            return {
                "epoch": self.epoch,
                "uptime_s": time.time() - self.started,
                "min_replicas": self.cfg.min_replicas,
                "max_step": self.max_step,
                "quorum": {k: v for k, v in self.quorum.items() if k != "members"} if self.quorum else None,
                "groups": [
                    {"group": g.group, "incarnation": g.incarnation, "healthy": g.healthy, "left": g.left,
                     "step": g.step, "ranks": len(g.ranks), "world": g.world,
                     "last_beat_age_s": max((now - r.last_beat for r in g.ranks.values()), default=None)}
                    for g in sorted(self.groups.values(), key=lambda g: g.group)
                ],
                "events": list(self.events)[-100:],
            }

    def close(self) -> None:
        self._stop.set()


def _status_html(st: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><td>{g['group']}</td><td>{g['incarnation']}</td><td>{'yes' if g['healthy'] else 'no'}</td>"
        f"<td>{g['step']}</td><td>{g['ranks']}/{g['world']}</td></tr>" for g in st["groups"])
    q = st["quorum"] or {}
    evs = "".join(f"<li>{time.strftime('%H:%M:%S', time.localtime(e['t']))} "
                  f"{html.escape(json.dumps(e))}</li>" for e in reversed(st["events"][-30:]))
    return (
        "<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='2'>"
        "<title>ftcore lighthouse</title></head><body style='font-family:sans-serif'>"
        f"<h1>ftcore lighthouse</h1><p>quorum {q.get('quorum_id', '-')}: groups {q.get('groups', [])}, "
        f"max committed step {st['max_step']}, min replicas {st['min_replicas']}</p>"
        "<table border=1 cellpadding=4><tr><th>group</th><th>incarnation</th><th>healthy</th>"
        f"<th>step</th><th>ranks</th></tr>{rows}</table><h2>recent events</h2><ul>{evs}</ul></body></html>"
    )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a heartbeat connection that closes means a dead rank
    lighthouse: Lighthouse

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: events are the log
        pass

    def handle(self) -> None:
        self._beat: tuple[int, int, int] | None = None
        try:
            super().handle()
        except (ConnectionError, OSError):
            pass
        finally:
            if self._beat is not None:
                self.lighthouse.disconnected(*self._beat)

    def _authorized(self) -> bool:
        header = self.headers.get(auth.HEADER)
        if header is None:
            qs = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
            header = f"Bearer {qs['token'][0]}" if "token" in qs else None
        if auth.allowed(self.lighthouse.cfg.token, header):
            return True
        self._send(401, {"error": "missing or wrong token"})
        return False

    def _send(self, code: int, body: Any, ctype: str = "application/json") -> None:
        raw = (json.dumps(body) if ctype == "application/json" else body).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        if not self._authorized():
            return
        path = urllib.parse.urlparse(self.path).path
        if path == "/status":
            self._send(200, self.lighthouse.status())
        elif path in ("/", "/index.html"):
            self._send(200, _status_html(self.lighthouse.status()), "text/html; charset=utf-8")
        else:
            self._send(404, {"error": f"no such path {path}"})

    def do_POST(self) -> None:
        if not self._authorized():
            return
        try:
            msg = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        except json.JSONDecodeError:
            self._send(400, {"error": "body is not JSON"})
            return
        lh = self.lighthouse
        try:
            if self.path == "/heartbeat":
                self._beat = (int(msg["group"]), int(msg["rank"]), int(msg.get("incarnation", 0)))
                self._send(200, lh.heartbeat(msg))
            elif self.path == "/register":
                with lh.lock:
                    lh._rank(msg)
                self._send(200, {"epoch": lh.epoch})
            elif self.path == "/quorum":
                timeout = min(float(msg.get("timeout", timeouts.QUORUM_TIMEOUT)), timeouts.QUORUM_TIMEOUT)
                q = lh.request_quorum(msg, timeout)
                self._send(409 if q.get("error") == "stale incarnation" else 504 if "error" in q else 200, q)
            elif self.path == "/report_failure":
                lh.report_failure(msg)
                self._send(200, {})
            elif self.path == "/leave":
                self._beat = None
                lh.leave(msg)
                self._send(200, {})
            elif self.path == "/event":
                lh.client_event(msg)
                self._send(200, {})
            else:
                self._send(404, {"error": f"no such path {self.path}"})
        except StaleIncarnation as e:
            self._beat = None
            self._send(409, {"error": str(e)})
        except (KeyError, ValueError, TypeError) as e:
            self._send(400, {"error": f"bad request: {e!r}"})


def serve(cfg: LighthouseConfig) -> tuple[ThreadingHTTPServer, Lighthouse]:
    """Start a lighthouse server in background threads; returns (server, lighthouse)."""
    host, _, port = cfg.bind.rpartition(":")
    lh = Lighthouse(cfg)
    handler = type("Handler", (_Handler,), {"lighthouse": lh})
    server = ThreadingHTTPServer((host or "127.0.0.1", int(port)), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="lighthouse-http").start()
    return server, lh


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftcore.lighthouse", description=__doc__.split("\n\n")[0])
    p.add_argument("--bind", default="127.0.0.1:29510", help="host:port to listen on (loopback by default)")
    p.add_argument("--min-replicas", type=int, default=1, help="fewest replica groups a quorum may have")
    p.add_argument("--expected-replicas", type=int, default=0,
                   help="groups the job starts with: the first quorum waits for all of them or the join timeout")
    p.add_argument("--join-timeout", type=float, default=timeouts.JOIN_TIMEOUT)
    p.add_argument("--heartbeat-timeout", type=float, default=timeouts.HEARTBEAT_TIMEOUT)
    p.add_argument("--token-file", help="file holding the shared token (else FTCORE_TOKEN / FTCORE_TOKEN_FILE)")
    p.add_argument("--events-file", help="append every event to this JSON-lines file")
    a = p.parse_args(argv)
    if a.min_replicas < 1:
        print("ftcore.lighthouse: --min-replicas must be >= 1", file=sys.stderr)
        return 2
    token = auth.read_token_file(a.token_file) if a.token_file else auth.token_from_env()
    cfg = LighthouseConfig(a.bind, a.min_replicas, a.expected_replicas, a.join_timeout, a.heartbeat_timeout,
                           token=token, events_file=a.events_file)
    try:
        server, lh = serve(cfg)
    except OSError as e:
        print(f"ftcore.lighthouse: cannot listen on {a.bind}: {e.strerror}; choose another --bind", file=sys.stderr)
        return 2
    print(json.dumps({"t": time.time(), "kind": "listening", "address": "%s:%d" % server.server_address[:2]}),
          flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
