"""The lighthouse's HTTP/1.1 front end: llhttp parses (httptools), one asyncio loop serves.
A connection is a protocol object (no thread); the token is checked on the headers before any
body is read. Bounded: connections (in total, per job, per peer, unauthenticated per peer), a request's
head, body and arrival time, pipelined bytes, and replies left unread; who makes way for whom
is ftcore/lighthouse_admission.py's rule (by job, then by address)."""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol

import httptools

from ftcore import auth, environment, timeouts
from ftcore.lighthouse_admission import AdmissionCounts, Caps, EvictIdle, EvictWaiting, Refuse, admit, settle
from ftcore.lighthouse_page import status_html
from ftcore.lighthouse_records import Answer, Deliver, StaleIncarnation
from ftcore.messages import (
    DEFAULT_JOB,
    ClientEvent,
    FailureReport,
    HeartbeatReply,
    MessageError,
    Quorum,
    QuorumRequest,
    RankInfo,
    job_id,
    loads,
)

MAX_BODY = 1 << 20  # bytes: larger bodies get 413, unread
MAX_HEAD = 16 << 10  # bytes of request line and headers
MAX_HEADERS = 64
MAX_PIPELINED = 256 << 10  # bytes of requests a client may queue behind one still being answered
REQUEST_OVERHEAD = 64  # bytes a queued request counts beyond its head and body (its record)
WRITE_HIGH = 256 << 10  # unread reply bytes past which a connection is not served until it reads
FIRST_REQUEST_S = 10.0  # a new connection must send its first request within this
REQUEST_S = 10.0  # a request must arrive whole within this of its first byte
IDLE_S = 600.0  # a quiet connection that is not a rank's newest heartbeat line is closed after this
JSON = "application/json"
LOOP_BEAT_S = 0.05  # the loop marks itself awake this often: a late mark is a loop behind on its input


class Membership(Protocol):
    """One job's ranks as the routes drive them: a lighthouse's Job, or a group's Relay."""

    def heartbeat(self, info: RankInfo, new_line: bool = False) -> HeartbeatReply: ...
    def disconnected(self, g: int, r: int, inc: int) -> None: ...
    def enqueue(self, ask: QuorumRequest, deliver: Deliver, timeout: float) -> Any: ...
    def withdraw(self, req: Any) -> None: ...


class Service(Protocol):
    """What the server serves: the Lighthouse (ftcore/lighthouse.py) or a Relay (ftcore/relay.py)."""

    cfg: Any  # token and the connection caps (lighthouse_admission.Caps.of)

    def job(self, info: RankInfo) -> Membership: ...
    def status(self, job: str = DEFAULT_JOB, everyone: bool = True) -> dict[str, Any]: ...
    def jobs_report(self) -> dict[str, Any]: ...
    def report_failure(self, report: FailureReport) -> None: ...
    def leave(self, info: RankInfo) -> None: ...
    def client_event(self, ev: ClientEvent) -> None: ...


def _response(code: int, raw: bytes, ctype: str = JSON, close: bool = False) -> bytes:
    """A whole response, in one buffer (one write: no Nagle wait between headers and body)."""
    head = f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\nContent-Type: {ctype}\r\nContent-Length: {len(raw)}\r\n"
    return (head + ("Connection: close\r\n\r\n" if close else "\r\n")).encode() + raw


def _raw_error(code: int, msg: str) -> bytes:
    return _response(code, json.dumps({"error": msg}).encode(), close=True)


class _Refused(Exception):
    """A request refused on its head: answered with `code` and the connection closed."""

    def __init__(self, code: int, msg: str):
        super().__init__(msg)
        self.code = code


@dataclass
class _Incoming:
    """The request a connection is reading, part by part (llhttp's callbacks)."""

    url: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    head_bytes: int = 0
    body: bytearray = field(default_factory=bytearray)
    scope: str | None = None  # whom it speaks for (its token's job, or ADMIN)


class Connection(asyncio.Protocol):
    """One client connection: llhttp's callbacks queue whole requests, answered in order, one at a time."""

    def __init__(self, server: LighthouseServer):
        self.srv = server
        self.parser = httptools.HttpRequestParser(self)
        self.peer = ""
        self.busy = False  # a request is being answered: later ones wait in the queue
        self.paused = False  # the client left WRITE_HIGH bytes of replies unread
        self.authed = False  # some request on this connection carried a valid token
        # whole requests not yet answered: (method, target, scope, body, keep-alive, bytes)
        self.queue: collections.deque[tuple[str, str, str | None, bytes, bool, int]] = collections.deque()
        self.queued = 0  # bytes of the requests in the queue
        self.req = _Incoming()  # the request being read
        self.keep_alive = True  # the request being answered allows another on this connection
        self.receiving_since: float | None = None
        self.beat: tuple[Membership, int, int, int] | None = None  # this connection's heartbeating rank
        self.waiting: tuple[Membership, Any] | None = None  # its pending quorum request
        self.opened = self.last = time.monotonic()
        self.served = 0
        self._in_process = False

    # ---- asyncio callbacks ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t: asyncio.Transport = transport  # type: ignore[assignment]
        self.t.set_write_buffer_limits(high=WRITE_HIGH)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if peer else ""
        refusal = self.srv.admit(self)
        if refusal:
            self.t.write(_raw_error(503, refusal))
            self.t.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.srv.release(self)
        if self.waiting is not None:
            job, req = self.waiting
            job.withdraw(req)
        if self.beat is not None:
            job, g, r, inc = self.beat
            job.disconnected(g, r, inc)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._process()

    def data_received(self, data: bytes) -> None:
        self.last = time.monotonic()
        if self.t.is_closing():
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            refused = e.__context__ if isinstance(e.__context__, _Refused) else _Refused(400, "bad request")
            return self._close_with(refused.code, str(refused))
        except httptools.HttpParserUpgrade:
            return self._close_with(400, "protocol upgrades are not served here")
        except httptools.HttpParserError as e:
            return self._close_with(400, f"malformed request: {e}")
        if self.queued > MAX_PIPELINED:
            self.t.abort()  # pipelining far ahead of its answers: no memory for that
            return
        self._process()

    # ---- llhttp callbacks: one request's parts -------------------------------------------
    def on_message_begin(self) -> None:
        self.req = _Incoming()
        self.receiving_since = self.receiving_since or time.monotonic()

    def on_url(self, url: bytes) -> None:
        self.req.url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.req.headers.append((name.lower(), value))
        self._count(len(name) + len(value))

    def _count(self, n: int) -> None:
        self.req.head_bytes += n
        if self.req.head_bytes > MAX_HEAD or len(self.req.headers) > MAX_HEADERS:
            raise _Refused(431, f"request head over {MAX_HEAD} bytes or {MAX_HEADERS} headers")

    def on_headers_complete(self) -> None:
        """Everything a request can be refused for, before its body is read."""
        names, first = _names(self.req.headers)
        if names[b"transfer-encoding"]:
            raise _Refused(400, "Transfer-Encoding is not accepted here; send a Content-Length")
        if names[b"content-length"] > 1:
            raise _Refused(400, "more than one Content-Length header")
        if self.parser.get_http_version() == "1.1" and not names[b"host"]:
            raise _Refused(400, "an HTTP/1.1 request needs a Host header")
        length = int(first.get(b"content-length", 0))
        if length > MAX_BODY:
            raise _Refused(413, f"body over {MAX_BODY} bytes")
        value = first.get(b"authorization", b"").decode("latin-1")
        # header only: a token in a URL ends up in logs, histories and Referer headers
        self.req.scope = auth.scope(self.srv.lh.cfg.token, value or None)
        if self.req.scope is None:
            raise _Refused(401, "missing or wrong token")
        if not self.authed:  # it counts for its token's job from now (an admin token's: ADMIN's, until
            self.authed = True  # a request names a job)
            self.srv.forget_unauthed(self)
            refusal = self.srv.acts_for(self, self.req.scope)
            if refusal:
                raise _Refused(503, refusal)

    def on_body(self, data: bytes) -> None:
        self.req.body += data

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode("latin-1")
        keep = self.parser.should_keep_alive()
        size = len(self.req.body) + self.req.head_bytes + REQUEST_OVERHEAD
        self.queue.append((method, self.req.url.decode("latin-1"), self.req.scope, bytes(self.req.body), keep, size))
        self.queued += size
        self.receiving_since = None

    # ---- answering -----------------------------------------------------------------------
    def _process(self) -> None:
        """Dispatch the next queued request. One read may hold many pipelined requests: the
        next one is taken up in a later turn of the loop (never by recursion), so every other
        connection is served between two requests of a client that pipelines many."""
        if self._in_process or not self.queue or self.busy or self.paused or self.t.is_closing():
            return
        self._in_process = True
        try:
            method, target, scope, body, self.keep_alive, size = self.queue.popleft()
            self.queued -= size
            self.busy = True
            self.srv.dispatch(self, method, target, scope, body)
        finally:
            self._in_process = False
        if self.queue and not self.busy:
            self.srv.loop.call_soon(self._process)

    def _close_with(self, code: int, msg: str) -> None:
        self.t.write(_raw_error(code, msg[:300]))
        self.t.close()

    def reply(self, code: int, body: Any, ctype: str = JSON) -> None:
        """Answer the request being served (in the loop's thread only)."""
        self.waiting = None
        if self.t.is_closing():
            return
        raw = (body if isinstance(body, str) else json.dumps(body)).encode()
        close = code in (400, 401, 403, 413, 503) or not self.keep_alive
        self.t.write(_response(code, raw, ctype, close))
        self.served += 1
        self.last = time.monotonic()
        self.busy = False
        self.srv.ledger.busy(self, False)
        if close:
            self.t.close()
        else:
            self._process()


def _names(headers: list[tuple[bytes, bytes]]) -> tuple[dict[bytes, int], dict[bytes, bytes]]:
    """How often each header name occurs, and its first value (one pass: this runs per request)."""
    names: dict[bytes, int] = collections.defaultdict(int)
    first: dict[bytes, bytes] = {}
    for n, v in headers:
        names[n] += 1
        first.setdefault(n, v)
    return names, first


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop (libuv) where it is installed, asyncio's otherwise or with
    FTCORE_UVLOOP=0: a burst of a thousand connections costs its C accept path a fraction of
    asyncio's task per connection, time every other client waits (BENCHMARKS.md, abuse)."""
    if environment.flag("FTCORE_UVLOOP", True):
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:
            pass
    return asyncio.new_event_loop()


class LighthouseServer:
    """The lighthouse's HTTP/1.1 front end: one asyncio loop in a daemon thread."""

    def __init__(self, lh: Service, host: str, port: int):
        self.lh = lh
        self.loop = _new_loop()
        self.conns: set[Connection] = set()
        self.ledger: AdmissionCounts[Connection] = AdmissionCounts()  # who holds them, by job and by address
        self._started = threading.Event()
        self.awake_at = time.monotonic()  # the loop's last mark (_awake)
        self._error: OSError | None = None
        self.server_address: tuple = ()
        self._thread = threading.Thread(target=self._run, args=(host, port), daemon=True, name="lighthouse-http")
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _run(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self._srv = self.loop.run_until_complete(
                self.loop.create_server(lambda: Connection(self), host, port, backlog=1024)
            )
            self.server_address = self._srv.sockets[0].getsockname()[:2]
        except OSError as e:
            self._error = e
        self._started.set()
        if self._error is None:
            self.loop.call_later(1.0, self._sweep)
            self.loop.call_soon(self._awake)
            self.loop.run_forever()

    def _awake(self) -> None:
        self.awake_at = time.monotonic()
        self.loop.call_later(LOOP_BEAT_S, self._awake)

    def read_until(self) -> float:
        """Up to when this server has surely read what arrived: a message since may still wait
        unread in its sockets (a loaded host, a burst), so silence after it is not its sender's."""
        return self.awake_at + LOOP_BEAT_S

    def admit(self, c: Connection) -> str:
        """Count a new connection in, or say why it is refused ("" when admitted): by
        lighthouse_admission.admit, which may close one connection to make room (one that sent
        no token for EVICT_AGE_S, or an idle one of a job past its share of a full lighthouse)."""
        now = time.monotonic()
        caps = Caps.of(self.lh.cfg)
        decision = admit(caps, c.peer, self.ledger.load(c.peer, now, full=len(self.ledger) >= caps.total))
        if isinstance(decision, Refuse):
            return decision.reason
        if isinstance(decision, EvictWaiting):
            self._evict(self.ledger.oldest_waiting(decision.peer))  # not a rank about to speak: ranks send at once
        elif isinstance(decision, EvictIdle):
            self._evict(self.ledger.oldest_idle(decision.job))
        self.conns.add(c)
        self.ledger.open(c, c.peer, now)
        return ""

    def acts_for(self, c: Connection, job: str) -> str:
        """`c` speaks for `job` (its token's scope, then the job its request names): past the
        job's bound its least recently used idle connection closes, or with none idle, this
        request is refused: the reason ("" when it is served)."""
        load = self.ledger.account(c, job)
        decision = settle(Caps.of(self.lh.cfg), load) if load is not None else None
        if isinstance(decision, EvictIdle):
            self._evict(self.ledger.oldest_idle(decision.job))
        return decision.reason if isinstance(decision, Refuse) else ""

    def forget_unauthed(self, c: Connection) -> None:
        """Called once a connection's token is accepted, and as it closes."""
        self.ledger.signed_in(c)

    def release(self, c: Connection) -> None:
        if c in self.conns:
            self.conns.discard(c)
            self.forget_unauthed(c)
            self.ledger.close(c)

    def _evict(self, c: Connection) -> None:
        self.release(c)
        c.t.abort()

    def _sweep(self) -> None:
        """Close connections that never spoke, went quiet (not a rank's newest heartbeat line: a
        stopped rank's silence is for the heartbeat timeout to judge; an older line of a rank that
        reconnected is not one) or send a request too slowly."""
        now = time.monotonic()
        for c in list(self.conns):
            slow = c.receiving_since is not None and now - c.receiving_since > REQUEST_S
            quiet = not c.busy and now - c.last > IDLE_S and not (c.beat is not None and self.ledger.is_line(c))
            if slow or quiet or (c.served == 0 and not c.busy and now - c.opened > FIRST_REQUEST_S):
                c.t.close()
        self.loop.call_later(1.0, self._sweep)

    def shutdown(self) -> None:
        def stop() -> None:
            self._srv.close()
            for c in list(self.conns):
                c.t.abort()
            self.loop.stop()

        if self.loop.is_running():
            self.loop.call_soon_threadsafe(stop)
            self._thread.join(timeout=5)

    # ---- routes ----------------------------------------------------------------------------
    def dispatch(self, conn: Connection, method: str, target: str, scope: str | None, raw: bytes) -> None:
        self.ledger.busy(conn, True)
        try:
            if method == "GET":
                return self._get(conn, urllib.parse.urlparse(target), scope)
            if method != "POST":
                return conn.reply(404, {"error": f"no {method} here"})
            self._post(conn, target.partition("?")[0], scope, loads(raw))
        except StaleIncarnation as e:
            self._line(conn, None)
            conn.reply(409, {"error": str(e)})
        except _Forbidden as e:
            conn.reply(403, {"error": str(e)})
        except _Crowded as e:
            conn.reply(503, {"error": str(e)})
        except (MessageError, ValueError, TypeError, UnicodeDecodeError, RecursionError) as e:
            conn.reply(400, {"error": f"bad request: {e}"[:500]})

    def _get(self, conn: Connection, url: urllib.parse.ParseResult, scope: str | None) -> None:
        lh = self.lh
        if url.path == "/jobs":
            self._speaks(conn, scope, None)
            return conn.reply(200, lh.jobs_report())
        job = job_id(urllib.parse.parse_qs(url.query).get("job", [DEFAULT_JOB])[0])
        self._speaks(conn, scope, job)
        if url.path == "/status":
            return conn.reply(200, lh.status(job, everyone=scope == auth.ADMIN))
        if url.path in ("/", "/index.html"):
            page = status_html(lh.status(job, everyone=scope == auth.ADMIN))
            return conn.reply(200, page, "text/html; charset=utf-8")
        return conn.reply(404, {"error": f"no such path {url.path}"})

    def _post(self, conn: Connection, path: str, scope: str | None, msg: Any) -> None:
        lh = self.lh
        if path == "/heartbeat":
            info = RankInfo.parse(msg)
            self._speaks(conn, scope, info.job)
            job_ = lh.job(info)
            line = (job_, info.group, info.rank, info.incarnation)
            reply = job_.heartbeat(info, new_line=conn.beat != line)  # validates: only then is it a rank's line
            if conn.beat is not None and conn.beat != line:
                conn.beat[0].disconnected(*conn.beat[1:])  # a line changes hands: count the old one out
            self._line(conn, line)
            return conn.reply(200, reply.to_wire())
        if path == "/quorum":
            ask = QuorumRequest.parse(msg)
            self._speaks(conn, scope, ask.info.job)
            return self._quorum(conn, lh.job(ask.info), ask)
        if path == "/report_failure":
            report = FailureReport.parse(msg)
            self._speaks(conn, scope, report.job)
            lh.report_failure(report)
        elif path == "/leave":
            info = RankInfo.parse(msg)
            self._speaks(conn, scope, info.job)
            lh.leave(info)
            self._line(conn, None)
        elif path == "/event":
            ev = ClientEvent.parse(msg)
            self._speaks(conn, scope, ev.job)
            lh.client_event(ev)
        else:
            return conn.reply(404, {"error": f"no such path {path}"})
        conn.reply(200, {})

    def _speaks(self, conn: Connection, scope: str | None, job: str | None) -> None:
        """`conn`'s token may act for `job` (else _Forbidden), and it counts as that job's
        connection (an admin token's counts for the job it names; _Crowded past the job's bound)."""
        _allow(scope, job)
        refusal = self.acts_for(conn, job) if job is not None else ""
        if refusal:
            raise _Crowded(refusal)

    def _line(self, conn: Connection, line: tuple[Membership, int, int, int] | None) -> None:
        """`conn` is now the heartbeat line of (job, group, rank, incarnation), or of no rank."""
        conn.beat = line
        self.ledger.line(conn, line[1:3] if line is not None else None)

    def _quorum(self, conn: Connection, job: Membership, ask: QuorumRequest) -> None:
        loop_thread = threading.get_ident()

        def answer(reply: str | Answer) -> None:
            if isinstance(reply, str):  # a quorum, encoded for this rank
                conn.reply(Quorum.status, reply)
            else:
                conn.reply(reply.status, reply.to_wire())

        def deliver(reply: str | Answer) -> None:  # under the job's lock: the ticker's thread or this loop's
            if threading.get_ident() == loop_thread:
                self.loop.call_soon(answer, reply)  # after this request's own dispatch has returned
            else:
                self.loop.call_soon_threadsafe(answer, reply)

        conn.waiting = (job, job.enqueue(ask, deliver, min(ask.timeout, timeouts.QUORUM_TIMEOUT)))


class _Forbidden(Exception):
    """A valid token used beyond its job (403)."""


class _Crowded(Exception):
    """A connection past its job's bound, none of the job's others idle (503)."""


def _allow(scope: str | None, job: str | None) -> None:
    """A job token speaks for its own job only; `job` None: a route for the admin token alone."""
    if scope == auth.ADMIN or (job is not None and scope == job):
        return
    if job is None:
        raise _Forbidden("this route needs the lighthouse's admin token, not a job token")
    raise _Forbidden(f"this token is job {scope!r}'s; it cannot act for job {job!r}")
