"""A replica group's relay: rank 0 speaks to the lighthouse for all K ranks (torchft's layout).
It serves the lighthouse's own protocol to the group's ranks and keeps one line and one quorum
request per round upstream: the lighthouse's cost grows with groups, not ranks. The group's
line is open while every rank's is (a death still shows at once); its heartbeat replies carry
the lighthouse's silence, so the ranks lease together."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from ftcore import preauth, timeouts
from ftcore.answers import QuorumRefused, parse_quorum_answer
from ftcore.lighthouse_client import LighthouseClient, LighthouseError, call
from ftcore.lighthouse_http import Connection, LighthouseServer
from ftcore.lighthouse_records import Deliver, StaleIncarnation
from ftcore.messages import (
    Busy,
    ClientEvent,
    FailureReport,
    HeartbeatReply,
    MessageError,
    Quorum,
    QuorumRequest,
    RankInfo,
)

# A group's beats to the lighthouse: half as often as a rank's (the lighthouse hears groups, and a
# busy one is spared most of its heartbeats); a loaded lighthouse asks for slower ones.
UPSTREAM_INTERVAL = min(2 * timeouts.HEARTBEAT_INTERVAL, timeouts.LIGHTHOUSE_SILENT / 2)


@dataclass
class RelayConfig:
    """What the HTTP server reads of its service: the token and the connection caps."""

    token: str | None
    max_connections: int
    max_connections_per_peer: int
    max_unauthenticated_per_peer: int = 16  # waiting for their token (see _RelayServer)


@dataclass
class _Member:
    store: str = ""
    heal: str = ""
    step: int = 0
    quorum_id: int = 0
    lines: int = 0  # its open heartbeat connections to this relay
    seen: bool = False


class Relay:
    """The relay of group `info.group` (`info`: rank 0's registration, `world` = K ranks)."""

    def __init__(self, lighthouse: str, info: RankInfo, token: str | None, host: str):
        k = info.world
        self.info, self.lighthouse, self.token = info, lighthouse, token
        self.cfg = RelayConfig(token, 4 * k + 16, 4 * k + 16)
        self.lock = threading.Lock()
        self.members = [_Member() for _ in range(k)]
        self.pending: dict[int, tuple[QuorumRequest, Deliver]] = {}
        self.lost = ""  # why this group cannot train on (a rank's line closed for good)
        self.leaving = False  # a rank said goodbye: the group ends cleanly
        self.upstream = LighthouseClient(lighthouse, replace(info, rank=0, relay=True), token, UPSTREAM_INTERVAL)
        self._beating = False
        self._rounds = ThreadPoolExecutor(1, thread_name_prefix="ftcore-relay")  # one round at a time
        self._notes = ThreadPoolExecutor(1, thread_name_prefix="ftcore-relay-notes")  # reports, events: in order
        self.server = _RelayServer(self, host)
        self.address = f"{host}:{self.server.server_address[1]}"

    # ---- what the HTTP server calls ------------------------------------------------------
    def job(self, info: RankInfo) -> Relay:
        i = self.info
        if (info.job, info.group, info.world) != (i.job, i.group, i.world):
            raise ValueError(f"this relay serves job {i.job} group {i.group} of {i.world} ranks only")
        if info.incarnation != i.incarnation:
            raise StaleIncarnation(f"group {i.group} incarnation {info.incarnation} is not this relay's")
        return self

    def _note(self, info: RankInfo) -> _Member:
        """Record a rank's addresses and step; the group's line opens once every rank spoke."""
        m = self.members[info.rank]
        moved = (info.store or m.store, info.heal or m.heal) != (m.store, m.heal)
        m.store, m.heal = info.store or m.store, info.heal or m.heal  # a connection's first message has them
        m.step, m.quorum_id, m.seen = info.step, info.quorum_id, True
        if all(x.seen for x in self.members):
            changes: dict[str, Any] = {"step": min(x.step for x in self.members)}
            changes["quorum_id"] = max(x.quorum_id for x in self.members)
            if moved or not self._beating:  # the address lists are joined when one changed only
                changes["store"] = ",".join(x.store for x in self.members)
                changes["heal"] = ",".join(x.heal for x in self.members)
            self.upstream.update(**changes)
            if not self._beating:
                self._beating = True
                self.upstream.start_heartbeats()
        return m

    def heartbeat(self, info: RankInfo, new_line: bool = False) -> HeartbeatReply:
        with self.lock:
            m = self._note(info)
            m.lines += new_line
            if all(x.lines for x in self.members) and not self.lost:
                self.upstream.resume()
            up, qid = self.upstream, self.upstream.latest_quorum_id
            abandoned = up.abandoned_quorum_id == qid > 0
            return HeartbeatReply(qid, up.failed_groups, round(up.silent_for(), 4), abandoned=abandoned)

    def disconnected(self, g: int, r: int, inc: int) -> None:
        """A rank's heartbeat line closed: so does the group's (the lighthouse sees it at once);
        if the rank is not back within the failure probe, the group is lost."""
        with self.lock:
            m = self.members[r]
            m.lines = max(m.lines - 1, 0)
            if m.lines or self.leaving:
                return
            self.upstream.hold()
        threading.Timer(timeouts.FAILURE_PROBE, self._judge, args=(r,)).start()

    def _judge(self, r: int) -> None:
        with self.lock:
            if self.members[r].lines or self.leaving or self.lost:
                return
            self.lost = f"replica group {self.info.group} lost rank {r}; restart the group"
            waiting, self.pending = self.pending, {}
        for _, deliver in waiting.values():
            deliver(QuorumRefused("lost", self.lost))

    def enqueue(self, ask: QuorumRequest, deliver: Deliver, timeout: float) -> tuple[int, QuorumRequest]:
        """A rank's request for this round; the group's goes up once every rank asked."""
        with self.lock:
            self._note(ask.info)
            r = ask.info.rank
            if self.lost:
                deliver(QuorumRefused("lost", self.lost))
                return r, ask
            old = self.pending.get(r)
            if old is not None:
                old[1](QuorumRefused("superseded", "superseded by a newer request"))
            self.pending[r] = (ask, deliver)
            if len(self.pending) == len(self.members):
                asks, self.pending = self.pending, {}
                self._rounds.submit(self._round, asks)
            return r, ask

    def withdraw(self, req: tuple[int, QuorumRequest]) -> None:
        with self.lock:
            r, ask = req
            if r in self.pending and self.pending[r][0] is ask:
                del self.pending[r]

    def report_failure(self, report: FailureReport) -> None:
        self.job(replace(self.info, group=report.group, incarnation=report.incarnation, job=report.job))
        self._notes.submit(self._forward, "/report_failure", report.to_wire())

    def client_event(self, ev: ClientEvent) -> None:
        if ev.job == self.info.job:
            self._notes.submit(self._forward, "/event", ev.to_wire())

    def leave(self, info: RankInfo) -> None:
        """The first goodbye ends the group cleanly at the lighthouse (the others follow)."""
        with self.lock:
            if self.leaving:
                return
            self.leaving = True
            self.upstream.update(step=info.step)  # the group's last step (its ranks commit together)
        self._notes.submit(self.upstream.leave)

    def status(self, job: str = "", everyone: bool = False) -> dict[str, Any]:
        with self.lock:
            return {
                "relay": {"job": self.info.job, "group": self.info.group, "lighthouse": self.lighthouse},
                "ranks": [{"rank": i, "lines": m.lines, "step": m.step} for i, m in enumerate(self.members)],
                "lost": self.lost,
            }

    def jobs_report(self) -> dict[str, Any]:
        return self.status()

    # ---- upstream -------------------------------------------------------------------------
    def _forward(self, path: str, body: dict[str, Any]) -> None:
        try:
            call(self.lighthouse, path, body, self.token)
        except OSError:
            pass  # best effort, as a rank's own: heartbeats and timeouts cover a lost note

    def _round(self, asks: dict[int, tuple[QuorumRequest, Deliver]]) -> None:
        """One request for the whole group; each rank gets the answer with its own addresses."""
        self._notes.submit(lambda: None).result()  # a rank's failure report arrives before the round
        request = group_request(self.upstream.info, [a for a, _ in asks.values()])
        try:
            status, body = self.upstream.exchange(request, request.timeout)
            answers = split_answer(status, body, len(self.members))
        except (LighthouseError, MessageError) as e:
            answers = [QuorumRefused("timeout", f"relay: {e}"[:500])] * len(self.members)
        if isinstance(answers[0], str):  # a quorum (parsed, valid): its ranks' beats now hear of it,
            self.upstream.heard(body["quorum_id"])  # not of an older beat's verdict
        for r, (_, deliver) in asks.items():
            deliver(answers[r])

    def close(self) -> None:
        self.server.shutdown()
        self._notes.shutdown(wait=True)  # a goodbye (each note is bounded by its RPC timeout)
        self.upstream.close()
        self._rounds.shutdown(wait=False, cancel_futures=True)


class _RelayServer(LighthouseServer):
    """The lighthouse's front end, its caps counting connections that showed a token only: a
    relay's are sized for its K ranks, and idle sockets must not fill them. One that has not
    shown a token within preauth.PREAUTH_S is closed; up to max_unauthenticated_per_peer per
    address wait for theirs (preauth.PreauthPool: the oldest makes way for a new one)."""

    def __init__(self, relay: Relay, host: str):
        self.preauth: preauth.PreauthPool[Connection] = preauth.PreauthPool()
        self.signed_in: Counter[str] = Counter()  # per address: connections that showed a token
        super().__init__(relay, host, 0)

    def admit(self, c: Connection) -> str:
        cfg = self.lh.cfg
        if self.signed_in.total() >= cfg.max_connections:
            return f"this relay has {cfg.max_connections} connections open"
        if self.signed_in[c.peer] >= cfg.max_connections_per_peer:
            return f"{c.peer} has {cfg.max_connections_per_peer} connections open to this relay"
        evicted = self.preauth.admit(c.peer, c, cfg.max_unauthenticated_per_peer)
        if evicted is not None:
            evicted.t.abort()
        self.conns.add(c)
        self.loop.call_later(preauth.PREAUTH_S, self._expire, c)
        return ""

    def _expire(self, c: Connection) -> None:
        if not c.authed:
            c.t.close()

    def forget_unauthed(self, c: Connection) -> None:
        """Called once a connection's token is accepted, and as it closes."""
        if self.preauth.leave(c.peer, c) and c.authed:
            self.signed_in[c.peer] += 1

    def release(self, c: Connection) -> None:
        if c in self.conns and c.authed:
            self.signed_in[c.peer] -= 1
            if self.signed_in[c.peer] <= 0:
                del self.signed_in[c.peer]
        super().release(c)


def group_request(info: RankInfo, asks: list[QuorumRequest]) -> QuorumRequest:
    """The group's request from its ranks': the lowest step, the slowest rank's compute with
    every rank's (when all measured it in the same quorum), "again"/"leased" when any says so."""
    first = asks[0]
    busy = [a.busy for a in asks]
    slowest = None
    if busy[0] is not None and all(b is not None and b.quorum_id == busy[0].quorum_id for b in busy):
        each = tuple(b.seconds for b in busy if b is not None)
        slowest = Busy(busy[0].quorum_id, max(each), each)
    return replace(
        first,
        info=replace(info, step=min(a.info.step for a in asks), quorum_id=max(a.info.quorum_id for a in asks)),
        busy=slowest,
        idle=first.idle if all(a.idle == first.idle for a in asks) else -1,
        leased=any(a.leased for a in asks),
        again=any(a.again for a in asks),
        timeout=min(a.timeout for a in asks),
    )


def split_answer(status: int, body: Any, k: int) -> list[str | Any]:
    """The lighthouse's answer to a group's request, as each of its k ranks' answer: a quorum as
    each rank's reply (JSON text), anything else as is."""
    if status == 200:
        answer = parse_quorum_answer(body)
        if not isinstance(answer, Quorum):
            return [answer] * k
        own = [a.split(",") for a in (answer.store, answer.heal_from, answer.update_from)]
        shared = answer.shared_json()
        return [Quorum.for_rank(shared, *(a[r] if r < len(a) else "" for a in own)) for r in range(k)]
    if status in (409, 410):
        return [QuorumRefused.parse(status, body)] * k
    return [QuorumRefused("timeout", f"the lighthouse refused the group's request ({status}: {body})"[:500])] * k
