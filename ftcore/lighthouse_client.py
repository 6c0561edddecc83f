"""A rank's side of the lighthouse protocol: heartbeats, quorum requests, failure reports.
Heartbeats go out on one kept-alive line whose close tells the lighthouse this process died;
a beat is skipped when a quorum request went out within the interval, and a loaded lighthouse
may ask for slower beats (HeartbeatReply.beat_s). Every message carries the full registration
(RankInfo), so a restarted lighthouse relearns the job."""

import http.client
import json
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any, Protocol

from ftcore import auth, timeouts
from ftcore.answers import OvertakenReply, QuorumRefused, StandbyReply, parse_quorum_answer
from ftcore.messages import (
    ClientEvent,
    FailureReport,
    HeartbeatReply,
    MessageError,
    Quorum,
    QuorumRequest,
    RankInfo,
    loads,
)

MAX_STALLED = 4  # unanswered heartbeat connections a rank keeps open (see _beat_loop)
MAX_NOTES = 256  # events waiting to be sent; more are dropped (a note is never worth a stall)


class LighthouseError(RuntimeError):
    """The lighthouse could not be reached or refused the request."""


class Replaced(LighthouseError):
    """This process belongs to a group incarnation that has been replaced: it must exit."""


class GroupLost(Replaced):
    """This process's group lost a rank (its process or its host died): it must exit so that
    the group is restarted whole (torchrun, the scheduler or the launcher)."""


class JobFinished(Replaced):
    """The job's training ended before this group could rejoin it: exit cleanly, writing nothing."""


class Overtaken(LighthouseError):
    """A leased round's late request: a peer already asks for a later step (the sender has
    moved on without this answer, and asks again in its current round)."""


class Standby(LighthouseError):
    """The lighthouse holds this group out of the quorum for now (fail-slow, ftcore/pace.py):
    ask again after `retry_s`; the group is alive and will rejoin through a heal."""

    def __init__(self, reason: str, retry_s: float):
        super().__init__(reason)
        self.retry_s = retry_s


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.removeprefix("http://").rstrip("/").rpartition(":")
    return host or "127.0.0.1", int(port)


def call(
    addr: str,
    path: str,
    body: dict[str, Any] | None,
    token: str | None,
    timeout: float = timeouts.RPC_TIMEOUT,
    method: str = "POST",
) -> tuple[int, Any]:
    """One HTTP request on a fresh connection; returns (status, decoded JSON body)."""
    host, port = _split(addr)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        raw = json.dumps(body).encode() if body is not None else None
        hdrs = {"Content-Type": "application/json", **auth.headers(token)}
        conn.request(method, path, body=raw, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read()
        try:
            return resp.status, loads(data)
        except ValueError:  # not JSON, or JSON out of bounds: the text says what came
            return resp.status, data[:500].decode(errors="replace")
    finally:
        conn.close()


class _Resend(Exception):
    """A quorum request to send again on a new connection."""


def _abort(conn: http.client.HTTPConnection | None) -> None:
    """Close with a reset: data still queued in the socket (a stale request) is never delivered."""
    if conn is not None and conn.sock is not None:
        try:
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    if conn is not None:
        conn.close()


class LighthouseHandle(Protocol):
    """What the manager needs of its lighthouse client (ftcore/manager.py; tests give it a fake)."""

    info: RankInfo
    replaced: bool
    failed_groups: tuple[int, ...]
    latest_quorum_id: int
    abandoned_quorum_id: int

    def update(self, **changes: Any) -> None: ...
    def start_heartbeats(self) -> None: ...
    def quorum(
        self, timeout: float = ..., request: QuorumRequest | None = None, leased: Callable[[], bool] = ...
    ) -> Quorum: ...
    def silent_for(self) -> float: ...
    def report_failure(self, quorum_id: int, error: str, stalled: bool = False) -> None: ...
    def event(self, kind: str, **data: Any) -> None: ...
    def leave(self) -> None: ...
    def close(self) -> None: ...


class LighthouseClient:
    """One rank's client. `info` is what this rank reports with every message; `update()`
    replaces it (it is immutable: the heartbeat thread always sends one whole version)."""

    def __init__(self, addr: str, info: RankInfo, token: str | None = None, interval: float | None = None):
        self.addr = addr
        self.interval = interval or timeouts.HEARTBEAT_INTERVAL  # between heartbeats, as configured
        self.pace = self.interval  # between heartbeats now: slower when the lighthouse asks
        self.token = token
        self.info = info
        self._info_lock = threading.Lock()  # update() from several threads loses no field
        self._verdict_lock = threading.Lock()  # heard(): beats and quorum answers from two threads
        self._qconn: http.client.HTTPConnection | None = None  # quorum requests, kept alive
        self._last_sent = 0.0  # monotonic time of the last quorum request (it refreshes liveness too)
        self._last_answer = time.monotonic()  # the lighthouse's last answer of any kind
        self.failed_groups: tuple[int, ...] = ()  # unhealthy members of the current quorum, per the last heartbeat
        self.replaced = False
        self.latest_quorum_id = 0  # the lighthouse's current quorum id, per the last heartbeat
        self.abandoned_quorum_id = 0  # the last quorum whose exchange a member reported failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: http.client.HTTPConnection | None = None
        self._stalled: list[http.client.HTTPConnection] = []
        self._live: http.client.HTTPConnection | None = None  # the heartbeat line now (hold() cuts it)
        self._held = threading.Event()
        self.recovered = 0  # times the heartbeats were answered again after going unanswered
        # events go out in order from a thread of their own: a silent lighthouse never holds up a
        # heal or a step for a note (each may wait an RPC timeout); a backlog past MAX_NOTES is dropped
        self._notes = ThreadPoolExecutor(1, thread_name_prefix="ftcore-events")
        self._noted = threading.Semaphore(MAX_NOTES)

    def update(self, **changes: Any) -> None:
        """Report these RankInfo fields from now on (step=..., quorum_id=...)."""
        with self._info_lock:
            self.info = replace(self.info, **changes)

    # ---- heartbeats ---------------------------------------------------------------
    # A rank's addresses (a relay's: every rank's, kilobytes) go with the first message on each
    # connection only; the lighthouse keeps them, and a restarted one hears them again at once
    # (every connection is new to it).
    def start_heartbeats(self) -> None:
        self._thread = threading.Thread(target=self._beat_loop, daemon=True, name="ftcore-heartbeat")
        self._thread.start()

    def _beat_loop(self) -> None:
        host, port = _split(self.addr)
        conn: http.client.HTTPConnection | None = None
        # Connections whose heartbeat went unanswered (a partition, a stalled lighthouse): the
        # lighthouse may count them as this rank's, and a rank is dead to it once its last one
        # closes. So they stay open until a heartbeat on a newer connection is answered, and
        # beats go on over a fresh connection meanwhile (a new connection also skips the long
        # retransmit backoff of a stalled one when the link comes back).
        stalled: list[http.client.HTTPConnection] = []
        hdrs = {"Content-Type": "application/json", **auth.headers(self.token)}
        while not self._stop.is_set():
            if self._held.is_set():  # gone to the lighthouse until resume(): no line at all
                for old in (conn, *stalled):
                    if old is not None:
                        old.close()
                conn, stalled = None, []
                self._stop.wait(self.pace)
                continue
            # A quorum request within the interval told the lighthouse this rank lives: skip this
            # beat (a job whose steps are shorter than the interval then sends no heartbeats at all).
            # The first beat always goes: it makes this connection the one whose close means death.
            quiet = self._last_sent + self.pace - time.monotonic()
            if conn is not None and quiet > 0:
                self._stop.wait(quiet)
                continue
            try:
                if conn is None:
                    conn = self._live = http.client.HTTPConnection(host, port, timeout=timeouts.RPC_TIMEOUT)
                info = self.info if conn.sock is None else replace(self.info, store="", heal="")
                conn.request("POST", "/heartbeat", body=json.dumps(info.to_wire()).encode(), headers=hdrs)
                resp = conn.getresponse()
                data = loads(resp.read())
                silent_s = 0.0
                if stalled:  # answered on this one: the lighthouse counts it, the old may go
                    self.recovered += 1
                for old in stalled:
                    old.close()
                stalled.clear()
                if resp.status == 409:
                    self.replaced = True
                elif resp.status == 200:
                    beat = HeartbeatReply.parse(data)
                    self.heard(beat.quorum_id, beat.failed, beat.abandoned)
                    self.pace = max(self.interval, min(beat.beat_s, timeouts.HEARTBEAT_TIMEOUT / 4))
                    silent_s = beat.silent_s  # through a relay: how long the lighthouse has not answered it
                self._last_answer = time.monotonic() - silent_s
            except TimeoutError:  # sent, unanswered: keep it open (bounded), go on over a new one
                if conn is not None and conn.sock is not None and len(stalled) < MAX_STALLED:
                    stalled.append(conn)
                elif conn is not None:
                    conn.close()
                conn = None
            except (OSError, http.client.HTTPException, ValueError):  # ValueError: bad JSON, MessageError
                if conn is not None:
                    conn.close()
                conn = None
            self._stop.wait(self.pace)
        self._conn = conn  # closed by leave()/close(), after the lighthouse knows why
        self._stalled = stalled

    def heard(self, quorum_id: int, failed: tuple[int, ...] = (), abandoned: bool = False) -> None:
        """The lighthouse's word on its quorum `quorum_id`: which members failed (a quorum's own
        answer: none, it holds only healthy ones), and whether its exchange was abandoned. A
        verdict about an older quorum than one already heard of is superseded: a beat answered
        before a round formed, or a relay's upstream beat from before its group's last round,
        must not fail a member of this one."""
        with self._verdict_lock:
            if quorum_id >= self.latest_quorum_id:
                self.failed_groups = failed
                if abandoned:
                    self.abandoned_quorum_id = quorum_id
            self.latest_quorum_id = max(self.latest_quorum_id, quorum_id)

    def hold(self) -> None:
        """Close the heartbeat line now and open none until `resume()`: to the lighthouse this
        rank is gone (a relay whose group lost a rank, ftcore/relay.py)."""
        self._held.set()
        conn = self._live
        if conn is not None and conn.sock is not None:
            try:  # wakes the heartbeat thread if it waits on this line
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def resume(self) -> None:
        self._held.clear()

    # ---- requests -------------------------------------------------------------------
    def quorum(
        self,
        timeout: float = timeouts.QUORUM_TIMEOUT,
        request: QuorumRequest | None = None,
        leased: Callable[[], bool] = lambda: False,
    ) -> Quorum:
        """Block until the lighthouse answers this round; retries while it is unreachable.
        `request`: what this rank reports for the round (its step...), fixed when the round
        began; by default one made of the current `info` alone. `leased`: whether the round has
        gone on without the lighthouse by now (a retry says so: the answer will be ignored)."""
        ask = request if request is not None else QuorumRequest(self.info)
        status, body = self.exchange(ask, timeout, leased)
        if status == 200:
            return self._answer(body)
        if status in (409, 410):
            refused = QuorumRefused.parse(status, body)
            if refused.reason == "stale":
                self.replaced = True
                raise Replaced(f"lighthouse {self.addr}: {refused.error}")
            if refused.reason == "finished":
                raise JobFinished(f"lighthouse {self.addr}: {refused.error}")
            raise GroupLost(f"lighthouse {self.addr}: {refused.error}")
        raise LighthouseError(f"lighthouse {self.addr} refused the quorum request ({status}: {body})")

    def exchange(
        self,
        request: QuorumRequest,
        timeout: float = timeouts.QUORUM_TIMEOUT,
        leased: Callable[[], bool] = lambda: False,
    ) -> tuple[int, Any]:
        """A quorum request's final answer as (status, body): 200, a refusal to act on (409,
        410) or a refused request (400, 401, 403); retried until then, within `timeout`, each
        try saying whether its round went on without the lighthouse meanwhile (`leased`)."""
        deadline = time.monotonic() + timeout
        last = "no attempt"
        while True:
            if not request.leased and leased():
                request = replace(request, leased=True)
            left = deadline - time.monotonic()
            if left <= 0:
                raise LighthouseError(f"no quorum from lighthouse {self.addr} within {timeout:.1f}s ({last})")
            try:
                status, body = self._ask_quorum(replace(request, timeout=left))
            except _Resend:  # the request sits in a stalled connection: send it again on a new one
                last = "resent after the lighthouse was heard again"
                _abort(self._qconn)
                self._qconn = None
                request = replace(request, again=True)  # its answer, if any, was lost with the connection
                continue
            except (OSError, http.client.HTTPException, ValueError) as e:  # ValueError: bad JSON
                last = f"{type(e).__name__}: {e}"
                if self._qconn is not None:
                    self._qconn.close()
                self._qconn = None
                time.sleep(min(0.05, max(left, 0)))
                continue
            if status in (200, 400, 401, 403, 409, 410):
                return status, body
            last = f"HTTP {status}: {body}"

    def _answer(self, body: Any) -> Quorum:
        """A 200's body: the quorum, or the Standby / Overtaken exception."""
        try:
            answer = parse_quorum_answer(body)
        except MessageError as e:
            raise LighthouseError(f"lighthouse {self.addr} sent a malformed quorum answer: {e}") from None
        if isinstance(answer, OvertakenReply):
            raise Overtaken(f"a peer asked for step {answer.step} before this leased round's request arrived")
        if isinstance(answer, StandbyReply):
            raise Standby(answer.reason, answer.retry_s)
        self.heard(answer.quorum_id)  # heartbeats pause while steps are short: the answer is newer
        return answer

    def _ask_quorum(self, request: QuorumRequest) -> tuple[int, Any]:
        """One quorum request on this rank's kept-alive connection (not one connection a step)."""
        if self._qconn is None:
            host, port = _split(self.addr)
            self._qconn = http.client.HTTPConnection(host, port)
        self._qconn.timeout = request.timeout + 1.0
        if self._qconn.sock is not None:
            self._qconn.sock.settimeout(request.timeout + 1.0)
        hdrs = {"Content-Type": "application/json", **auth.headers(self.token)}
        self._last_sent = sent = time.monotonic()
        recovered = self.recovered
        if self._qconn.sock is not None:  # addresses go with a connection's first message (see the heartbeats' note)
            request = replace(request, info=replace(request.info, store="", heal=""))
        self._qconn.request("POST", "/quorum", body=json.dumps(request.to_wire()).encode(), headers=hdrs)
        # Wait for the answer; if meanwhile the heartbeats stalled and came back (a partition),
        # this request may sit in its connection's retransmit backoff for seconds longer: resend
        # (the lighthouse lets a rank's newer request supersede its older one).
        sock = self._qconn.sock
        while sock is not None and not select.select([sock], [], [], 0.1)[0]:
            if self.recovered != recovered:
                raise _Resend()
            if time.monotonic() - sent > request.timeout + 1.0:
                raise TimeoutError("no answer to the quorum request")
        resp = self._qconn.getresponse()
        data = resp.read()
        self._last_answer = time.monotonic()  # a relay answers once the lighthouse did
        return resp.status, loads(data)

    def silent_for(self) -> float:
        """Seconds since the lighthouse last answered this rank (heartbeat or quorum), less the
        longer gap between beats it asked for: paced beats never make it look silent."""
        return max(time.monotonic() - self._last_answer - (self.pace - self.interval), 0.0)

    def _fire(self, path: str, body: dict[str, Any]) -> None:
        try:
            call(self.addr, path, body, self.token)
        except (OSError, http.client.HTTPException):
            pass  # best effort: heartbeats and timeouts cover a lost report

    def report_failure(self, quorum_id: int, error: str, stalled: bool = False) -> None:
        """Retried within one RPC timeout: a lost report would leave the survivors waiting for
        the failure probe or the heartbeat timeout instead of re-forming at once."""
        i = self.info
        body = FailureReport(i.job, i.group, i.rank, i.incarnation, quorum_id, error, stalled).to_wire()
        deadline = time.monotonic() + timeouts.RPC_TIMEOUT
        while True:
            try:
                if (
                    call(self.addr, "/report_failure", body, self.token, timeout=max(0.1, deadline - time.monotonic()))[
                        0
                    ]
                    == 200
                ):
                    return
            except (OSError, http.client.HTTPException):
                pass
            if time.monotonic() + 0.05 >= deadline:
                return
            time.sleep(0.05)

    def event(self, kind: str, **data: Any) -> None:
        """Send an event for the timeline, in the background (best effort, in order)."""
        body = ClientEvent(kind, self.info.job, {"group": self.info.group, "rank": self.info.rank, **data}).to_wire()
        if self._noted.acquire(blocking=False):
            self._notes.submit(self._note, body)

    def _note(self, body: dict[str, Any]) -> None:
        try:
            self._fire("/event", body)
        finally:
            self._noted.release()

    def _flush_notes(self) -> None:
        """The events sent so far reach the lighthouse first (within an RPC timeout)."""
        try:
            self._notes.submit(lambda: None).result(timeout=timeouts.RPC_TIMEOUT)
        except (FutureTimeout, RuntimeError):  # a silent lighthouse, or already shut down
            pass

    def _stop_beats(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def leave(self) -> None:
        """Say goodbye, so the lighthouse records a clean exit rather than a failure."""
        self._stop_beats()
        self._flush_notes()
        self._fire("/leave", self.info.to_wire())
        self.close()

    def close(self) -> None:
        self._stop_beats()
        self._notes.shutdown(wait=False, cancel_futures=True)
        for conn in (self._conn, self._qconn, *self._stalled):
            if conn is not None:
                conn.close()
        self._conn = self._qconn = None
        self._stalled = []
