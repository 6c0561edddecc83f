"""Catch-up from a peer: each rank's background server of heal snapshots, and the fetch.
A heal source offers its state (cloned before its optimizer step) while the healing rank
downloads it (tensorfile format, nothing unpickled): GET /snapshot/<step> is 200, 410 (moved
past it) or 504 (none in time). The exchange's first member offers a step's average the same
way (/update/<step>) to the members aside from it (Quorum.aside). Bounded like the lighthouse."""

import http.client
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from ftcore import auth, preauth, tensorfile, timeouts

HEAD_S = preauth.PREAUTH_S  # a client must send its request line and token within this
TRANSFER_S = 600.0  # ... and read the whole snapshot within this after it is ready
MAX_CONNECTIONS = 128
KINDS = ("snapshot", "update")  # what a server offers, one step of each at a time


class HealError(RuntimeError):
    """The snapshot could not be fetched; the recovering group retries at the next quorum."""


class SnapshotGone(LookupError):
    """The heal server has moved past the step asked for (it offers a later one now)."""


def clone_tree(tree: Any) -> Any:
    """A deep copy of every tensor in `tree` (the snapshot must not see later updates)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [clone_tree(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(clone_tree(v) for v in tree)
    if type(tree).__module__ == "numpy" and hasattr(tree, "copy"):
        return tree.copy()
    return tree


class HealServer:
    """This rank's snapshot server (one thread per download), offering one step of each kind at a time."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        token: str | None = None,
        on_serve: Callable[[int], None] | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ):
        self.token = token
        self.on_serve = on_serve  # fault-injection hook, called before streaming
        self._cond = threading.Condition()
        self._offers: dict[str, tuple[int, Any]] = dict.fromkeys(KINDS, (-1, None))
        self.served = 0
        handler = type("HealHandler", (_Handler,), {"server_obj": self})
        self.httpd = _BoundedServer((host, 0), handler, max_connections)
        self.address = "{}:{}".format(*self.httpd.server_address[:2])
        threading.Thread(target=self.httpd.serve_forever, daemon=True, name="ftcore-heal").start()

    def offer(self, step: int, tree: Any, kind: str = "snapshot") -> None:
        """Make `tree` (the state after `step` commits, or that step's average) available; cloned."""
        snap = clone_tree(tree)
        with self._cond:
            self._offers[kind] = (step, snap)
            self._cond.notify_all()

    def withdraw(self, kind: str) -> None:
        """Stop offering `kind` (its memory is freed; a late fetch of that step gets 504)."""
        with self._cond:
            if self._offers[kind][1] is not None:
                self._offers[kind] = (self._offers[kind][0], None)

    def wait_for(self, step: int, timeout: float, kind: str = "snapshot") -> Any | None:
        """The `kind` offer of `step` once made, or None when none came within `timeout`;
        SnapshotGone when a later step is offered instead."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._offers[kind][0] < step:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            at, tree = self._offers[kind]
            if at != step:
                raise SnapshotGone(f"step {step} is gone; this server is past it (at {at})")
            return tree

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _BoundedServer(ThreadingHTTPServer):
    """One thread per connection; at most `max_connections` serving (a token shown), and at most
    preauth.PER_PEER per address still reading their request (the oldest makes way): idle sockets
    take no serving slot."""

    daemon_threads = True
    request_queue_size = 1024  # a whole job's ranks may heal from this one at once: no resets

    def __init__(self, addr: tuple[str, int], handler: type, max_connections: int):
        self.slots = threading.BoundedSemaphore(max_connections)
        self.lock = threading.Lock()
        self.preauth: preauth.PreauthPool[socket.socket] = preauth.PreauthPool()
        self.serving: set[socket.socket] = set()
        super().__init__(addr, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.lock:
            evicted = self.preauth.admit(client_address[0], request)
        if evicted is not None:
            _cut(evicted)  # its handler's read ends; its thread cleans up after it
        super().process_request(request, client_address)

    def authenticated(self, request: socket.socket, peer: str) -> bool:
        """`request` showed a valid token: it leaves the pre-auth pool and takes a serving slot
        (False: every slot is busy)."""
        with self.lock:
            self.preauth.leave(peer, request)
        if not self.slots.acquire(blocking=False):
            return False
        with self.lock:
            self.serving.add(request)
        return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.preauth.leave(client_address[0], request)
                held = request in self.serving
                self.serving.discard(request)
            if held:
                self.slots.release()


def _refuse(sock: socket.socket) -> None:
    try:
        sock.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    except OSError:
        pass


def _cut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Handler(BaseHTTPRequestHandler):
    server_obj: HealServer
    timeout = HEAD_S  # per read; the deadlines below bound the whole request
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        self._watchdog: threading.Timer | None = None
        self._deadline(HEAD_S)

    def _deadline(self, seconds: float) -> None:
        """Shut the socket down `seconds` from now unless the request is over by then."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = threading.Timer(seconds, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expire(self) -> None:
        _cut(self.connection)

    def finish(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        super().finish()

    def log_message(self, fmt: str, *args: Any) -> None:
        pass

    def _plain(self, code: int, msg: str) -> None:
        raw = msg.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        srv = self.server_obj
        if not auth.allowed(srv.token, self.headers.get(auth.HEADER)):
            self._plain(401, "missing or wrong token")
            return
        if not self.server.authenticated(self.connection, self.client_address[0]):  # type: ignore[attr-defined]
            _refuse(self.connection)  # every serving slot is busy (with clients that showed a token)
            self.close_connection = True
            return
        parts = self.path.strip("/").split("/")
        if len(parts) != 2 or parts[0] not in KINDS:
            self._plain(404, "GET /snapshot/<step> or /update/<step>")
            return
        kind = parts[0]
        if not (parts[1].isascii() and parts[1].isdigit() and len(parts[1]) <= 15):
            self._plain(400, f"the step in /{kind}/<step> must be a non-negative integer")
            return
        step = int(parts[1])
        self._deadline(timeouts.HEAL_TIMEOUT + TRANSFER_S)
        self.connection.settimeout(timeouts.HEAL_TIMEOUT + 5)
        try:
            tree = srv.wait_for(step, timeouts.HEAL_TIMEOUT, kind)
        except SnapshotGone as e:
            self._plain(410, str(e))
            return
        if tree is None:
            self._plain(504, f"no {kind} for step {step} yet")
            return
        if srv.on_serve and kind == "snapshot":
            srv.on_serve(step)  # may raise (fault injection): the connection just drops
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        tensorfile.write(tree, self.wfile, {"step": str(step)})
        srv.served += 1


WATCH_S = 0.05  # how often a fetch asks whether to give up (a hung source closes nothing)


def fetch(
    addr: str,
    step: int,
    token: str | None,
    timeout: float = timeouts.HEAL_TIMEOUT,
    kind: str = "snapshot",
    abort: Callable[[], bool] | None = None,
) -> Any:
    """Download the state after `step` commits (or, kind "update", that step's average) from the
    heal server at `addr`. `abort()`: give up as soon as it says so (the lighthouse failed the
    source), not after `timeout`: a hung source keeps its connection open."""
    host, _, port = addr.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    done, gave_up = threading.Event(), threading.Event()
    if abort is not None:
        threading.Thread(target=_watch, args=(conn, abort, done, gave_up), daemon=True, name="ftcore-fetch").start()
    try:
        conn.request("GET", f"/{kind}/{step}", headers=auth.headers(token))
        resp = conn.getresponse()
        if resp.status != 200:
            raise HealError(f"heal server {addr} answered {resp.status}: {resp.read()[:200].decode(errors='replace')}")
        tree, meta = tensorfile.read(resp)
        if meta.get("step") != str(step):
            raise HealError(f"heal server {addr} sent step {meta.get('step')}, wanted {step}")
        return tree
    except (OSError, http.client.HTTPException, tensorfile.FormatError) as e:
        if gave_up.is_set():
            raise HealError(f"fetching step {step} from {addr} given up: its source failed") from None
        raise HealError(f"fetching step {step} from {addr} failed: {type(e).__name__}: {e}") from None
    finally:
        done.set()
        conn.close()


def _watch(
    conn: http.client.HTTPConnection, abort: Callable[[], bool], done: threading.Event, gave_up: threading.Event
) -> None:
    """Shut the fetch's socket down once `abort()` says so: its blocked read returns at once."""
    while not done.wait(WATCH_S):
        if gave_up.is_set() or abort():
            gave_up.set()
            sock = conn.sock
            if sock is not None:  # else not connected yet: shut it down at the next tick
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
