"""The lighthouse under abuse while a real job trains against it.

    python benchmarks/lighthouse_abuse.py [--json PATH]
    python benchmarks/lighthouse_abuse.py --case crowd [--json PATH]   # job against job, no training

One standing lighthouse (`python -m ftcore.lighthouse`, an admin secret, loopback). A real
2-group job (`python -m training launch --lighthouse ... --job-id bench`, the trainer on a small
synthetic shard set) trains against it while an attacker holding only another job's token
("flood"), bounded in count and time, sends it:

- malformed requests: garbage, non-UTF-8 bodies, `Infinity`, non-object JSON, a non-numeric
  Content-Length, bodies over 1 MiB, chunked bodies, two Content-Lengths, 400-digit integers;
- a wrong token announcing a 1 MB body (answered before the body), 1,000 concurrent
  connections without the token, and 200 idle sockets that never speak;
- 1,000 pipelined requests in one write, and a connection that pipelines without ever reading;
- 100 half-sent bodies with its own token, 1 MB events and many 1 KB events;
- its own token against job "bench": heartbeats with a huge incarnation, failure reports,
  events and status reads of the other job;
- a rank flood of a job of its own.

Reported: requests tried and how they were answered, the job's outcome (exit code, both groups'
final states equal, heartbeat timeouts), `/status` latency throughout (p50, p99, max,
failures), the lighthouse's RSS before and after, and connections still open after the
attack that never sent a token.

`--case crowd` (issue #41, seconds, no training): the connection caps scaled down 128x (512 in
all, 128 per address, 2 without a token per address); job "hog" fills the lighthouse from four
addresses with 64 ranks' heartbeat lines, idle connections with its token and idle ones without;
then another job makes 50 new connections each for a heartbeat and a `/status`. Reported: how
many of those were answered 200 on their first try, their latency (p50, max), and whether every
one of the hog's lines still answers. Run from an older tree's copy of this script to compare.
"""

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftcore import auth  # noqa: E402
from ftcore.util.files import atomic_write_json  # noqa: E402
from ftcore.util.procs import free_port  # noqa: E402

SECRET = "abuse-bench-secret"
FLOOD = auth.job_token(SECRET, "flood")  # what the attacker holds: its own job's token
BENCH = auth.job_token(SECRET, "bench")
POLL_S = 0.1  # the job's /status is read this often while the attack runs


def _raw(port: int, data: bytes, timeout: float = 5.0) -> str:
    """Send bytes on a fresh connection; the reply's status code, or what happened instead."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(data)
            head = s.recv(64)
            return head.split(b" ")[1].decode() if head.startswith(b"HTTP/1.1 ") else "closed"
    except OSError as e:
        return type(e).__name__


def _post(path: str, body: bytes, token: str | None = FLOOD, length: str | None = None, extra: str = "") -> bytes:
    bearer = f"Authorization: Bearer {token}\r\n" if token else ""
    head = f"POST {path} HTTP/1.1\r\nHost: lh\r\n{bearer}Content-Length: {length or len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def _get(path: str, token: str | None) -> bytes:
    bearer = f"Authorization: Bearer {token}\r\n" if token else ""
    return f"GET {path} HTTP/1.1\r\nHost: lh\r\n{bearer}\r\n".encode()


def _rss_mb(pid: int) -> float:
    return next(int(x.split()[1]) for x in open(f"/proc/{pid}/status") if x.startswith("VmRSS:")) / 1024


MALFORMED = {
    "not UTF-8": _post("/heartbeat", b"\xff\xfe\xfd"),
    "Infinity": _post("/heartbeat", b"Infinity"),
    "not an object": _post("/quorum", b"[1,2]"),
    "length not a number": _post("/heartbeat", b"", length="abc"),
    "body over 1 MiB": _post("/heartbeat", b"x" * (2 << 20)),
    "garbage": b"GARBAGE\r\n\r\n",
    "rank beyond its world": _post("/heartbeat", b'{"group": 0, "rank": 5, "world": 2, "job": "flood"}'),
    "group beyond the job": _post(
        "/heartbeat", b'{"group": 99, "rank": 0, "world": 1, "num_groups": 2, "job": "flood"}'
    ),
    "quorum_id 1e30": _post("/heartbeat", b'{"group": 0, "rank": 0, "quorum_id": 1e30, "job": "flood"}'),
    "chunked body": _post("/heartbeat", b"2\r\n{}\r\n0\r\n\r\n", extra="Transfer-Encoding: chunked\r\n"),
    "two lengths": _post("/heartbeat", b"{}", extra="Content-Length: 9\r\n"),
    "400-digit timeout": _post("/quorum", b'{"job": "flood", "group": 0, "rank": 0, "timeout": ' + b"9" * 400 + b"}"),
    "400-digit busy": _post("/quorum", b'{"job": "flood", "group": 0, "rank": 0, "busy": [1, ' + b"9" * 400 + b"]}"),
    "1 MB event": _post("/event", json.dumps({"job": "flood", "kind": "x", "v": "x" * (1 << 20)}).encode()),
    "wrong token, 1 MB announced": _post("/heartbeat", b"", token="nope", length=str(1 << 20)),
    "other job: huge incarnation": _post(
        "/heartbeat", json.dumps({"job": "bench", "group": 0, "rank": 0, "incarnation": 2**52}).encode()
    ),
    "other job: failure report": _post(
        "/report_failure",
        json.dumps({"job": "bench", "group": 0, "rank": 0, "incarnation": 0, "quorum_id": 1, "error": "x"}).encode(),
    ),
    "other job: event": _post("/event", b'{"job": "bench", "kind": "forged"}'),
    "other job: status": _get("/status?job=bench", FLOOD),
    "all jobs: /jobs": _get("/jobs", FLOOD),
}


def _pipelined(port: int, tally: Counter) -> None:
    """1,000 requests in one write: every one answered, in order."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(_get("/status?job=flood", FLOOD) * 1000)
        got = b""
        while got.count(b"HTTP/1.1 ") < 1000:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            got += chunk
    tally[f"1000 pipelined -> {got.count(b'HTTP/1.1 200')} answered 200"] += 1


def _never_reads(port: int, tally: Counter) -> None:
    """Pipelines requests and never reads a reply: served until its unread replies pile up, then dropped."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sent = 0
        try:
            for _ in range(2000):
                s.sendall(_get("/status?job=flood", FLOOD) * 100)
                sent += 100
        except OSError as e:
            tally[f"never reads -> dropped ({type(e).__name__})"] += 1
            return
    tally[f"never reads -> still open after {sent} requests"] += 1


def _half_sent(port: int, n: int) -> list[socket.socket]:
    """n bodies announced at 1 MB and sent in part, with the attacker's own token."""
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(_post("/event", b"x" * 60000, length=str(1 << 20)))
        out.append(s)
    return out


def abuse(port: int, stop: threading.Event, tally: Counter) -> None:
    rounds = 0
    while not stop.is_set() and rounds < 40:
        rounds += 1
        for what, m in MALFORMED.items():
            tally[f"{what} -> {_raw(port, m)}"] += 1
        # concurrent connections without the token (1,000 in the first round)
        results: list[str] = []
        lock = threading.Lock()

        def one(results: list[str], lock: threading.Lock) -> None:
            r = _raw(port, _get("/status", None), timeout=10)
            with lock:
                results.append(r)

        ts = [threading.Thread(target=one, args=(results, lock)) for _ in range(1000 if rounds == 1 else 100)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for r in results:
            tally[f"no token -> {r}"] += 1
        _pipelined(port, tally)
        if rounds <= 3:
            _never_reads(port, tally)
        half = _half_sent(port, 100 if rounds == 1 else 10)
        for i in range(20):  # events of its own job: kept, but bounded
            body = json.dumps({"job": "flood", "kind": "spam", "v": "x" * 900, "i": i}).encode()
            tally[f"1 KB event -> {_raw(port, _post('/event', body))}"] += 1
        for i in range(50):  # a rank flood of a job of its own
            body = json.dumps({"job": "flood", "group": i % 64, "rank": 0, "world": 1, "num_groups": 64}).encode()
            tally[f"flood heartbeat -> {_raw(port, _post('/heartbeat', body))}"] += 1
        for s in half:
            s.close()
        stop.wait(0.2)


def _send(s: socket.socket, data: bytes) -> str:
    s.sendall(data)
    head = s.recv(65536)
    return head.split(b" ")[1].decode() if head.startswith(b"HTTP/1.1 ") else "closed"


def _beat(job: str, g: int, token: str) -> bytes:
    info = {"group": g, "rank": 0, "world": 1, "job": job, "num_groups": 64, "store": "127.0.0.1:1"}
    return _post("/heartbeat", json.dumps(info).encode(), token)


def _fill(port: int, hog: str, lines: list[socket.socket], idle: list[socket.socket]) -> None:
    """Job "hog" from four addresses: 64 ranks' heartbeat lines, then idle connections (half
    with its token) until more than fit."""
    for g in range(64):
        lines.append(socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{2 + g % 4}", 0)))
        _send(lines[-1], _beat("hog", g, hog))
    for i in range(1000):  # more than fit: idle, half with its token
        try:
            s = socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{2 + i % 4}", 0))
            idle.append(s)
            if i % 2:
                _send(s, _get("/status?job=hog", hog))
        except OSError:
            pass


def crowd(json_path: str) -> int:
    """Job against job at scaled-down caps (module docstring, `--case crowd`)."""
    import contextlib
    import io
    from dataclasses import fields

    from ftcore.lighthouse import LighthouseConfig, serve

    caps: dict[str, Any] = {"max_connections": 512, "max_connections_per_peer": 128, "max_unauthenticated_per_peer": 2}
    known = {f.name for f in fields(LighthouseConfig)}  # an older tree's config may lack some
    srv, lh = serve(
        LighthouseConfig(token=SECRET, heartbeat_timeout=60.0, **{k: v for k, v in caps.items() if k in known})
    )
    port, hog, late = srv.server_address[1], auth.job_token(SECRET, "hog"), auth.job_token(SECRET, "late")
    lines: list[socket.socket] = []
    idle: list[socket.socket] = []
    lat: list[float] = []
    ok = 0
    quiet = contextlib.redirect_stdout(io.StringIO())  # the lighthouse's events, one line each
    quiet.__enter__()
    try:
        _fill(port, hog, lines, idle)
        for g in range(50):
            for req in (_beat("late", g, late), _get("/status?job=late", late)):
                t = time.monotonic()
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                        ok += _send(s, req) == "200"
                except OSError:
                    pass
                lat.append(time.monotonic() - t)
        hog_lines = sum(_send(s, _beat("hog", g, hog)) == "200" for g, s in enumerate(lines))
    finally:
        for s in lines + idle:
            s.close()
        lh.close()
        srv.shutdown()
        quiet.__exit__(None, None, None)
    lat.sort()
    row = {
        "case": "crowd",
        "caps": caps,
        "late_answered_200": ok,
        "late_of": len(lat),
        "late_p50_ms": round(1000 * statistics.median(lat), 2),
        "late_max_ms": round(1000 * max(lat), 2),
        "hog_lines_answered": hog_lines,
        "hog_lines_of": len(lines),
    }
    print(json.dumps(row, indent=1))
    atomic_write_json(json_path, row, indent=1)
    return 0 if ok == len(lat) and hog_lines == len(lines) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="default bench-results/lighthouse_abuse[_crowd].json")
    p.add_argument("--case", choices=["train", "crowd"], default="train", help="crowd: job against job, no training")
    a = p.parse_args()
    if a.case == "crowd":
        return crowd(a.json or str(ROOT / "bench-results" / "lighthouse_abuse_crowd.json"))
    a.json = a.json or str(ROOT / "bench-results" / "lighthouse_abuse.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FTCORE_TOKEN": SECRET}
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        events, shards = Path(d) / "ev.txt", Path(d) / "shards"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "dataprep",
                "synth",
                "--out",
                str(events),
                "--users",
                "800",
                "--items",
                "200",
                "--quiet",
            ],
            env=env,
            cwd=ROOT,
            check=True,
            timeout=120,
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "dataprep",
                "shards",
                "--input",
                str(events),
                "--format",
                "sasrec",
                "--out",
                str(shards),
                "--world-size",
                "2",
                "--batch-size",
                "16",
                "--max-len",
                "20",
                "--quiet",
            ],
            env=env,
            cwd=ROOT,
            check=True,
            timeout=180,
        )
        lh = subprocess.Popen(
            [sys.executable, "-m", "ftcore.lighthouse", "--bind", f"127.0.0.1:{port}"],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        idle = []
        try:
            deadline = time.monotonic() + 30
            while _raw(port, _get("/status", None)) not in ("401", "200"):
                if time.monotonic() > deadline:
                    raise SystemExit("the lighthouse did not start")
                time.sleep(0.1)
            rss0 = _rss_mb(lh.pid)
            idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
            job = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "training",
                    "launch",
                    "--shards",
                    str(shards),
                    "--replica-groups",
                    "2",
                    "--lighthouse",
                    f"127.0.0.1:{port}",
                    "--job-id",
                    "bench",
                    "--out",
                    str(Path(d) / "run"),
                    "--timeout",
                    "400",
                    "--",
                    "--set",
                    "train.epochs=6",
                    "model.dim=16",
                    "loss.kind=sampled_softmax",
                    "loss.num_negatives=16",
                    "mlflow.enabled=false",
                    "eval.periodic=false",
                    "eval.batch_size=256",
                ],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            # the job's monitor is a process of its own: in the attacker's, its reads would wait
            # for the GIL behind a thousand attacking threads, and count that as the lighthouse's
            ctx = mp.get_context("fork")
            polling, polled = ctx.Event(), ctx.Queue()
            poller = ctx.Process(target=_poll, args=(port, polling, polled), daemon=True)
            poller.start()
            stop, tally = threading.Event(), Counter[str]()
            attacker = threading.Thread(target=abuse, args=(port, stop, tally))
            attacker.start()
            while job.poll() is None:
                time.sleep(0.2)
            stop.set()
            polling.set()
            lat, fails = polled.get(timeout=60)
            poller.join(timeout=10)
            attacker.join()
            rss1 = _rss_mb(lh.pid)
            time.sleep(1.5)  # a sweep of the server's
            open_idle = sum(1 for s in idle if _still_open(s))
            assert job.stdout is not None  # stdout=PIPE
            log = job.stdout.read()
            sums = [line.split("checksum ")[1].split()[0] for line in log.splitlines() if " checksum " in line]
        finally:
            for s in idle:
                s.close()
            lh.kill()
            lh.wait()
    lat.sort()
    row = {
        "job_exit_code": job.returncode,
        "final_states_equal": len(sums) == 2 and len(set(sums)) == 1,
        "heartbeat_timeouts": log.count('"reason": "heartbeat timeout"'),
        "status_polls": len(lat),
        "status_failures": fails,
        "status_p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
        "status_p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 1) if lat else None,
        "status_max_ms": round(1000 * max(lat), 1) if lat else None,
        "lighthouse_rss_mb": [round(rss0, 1), round(rss1, 1)],
        "idle_sockets_still_open": open_idle,
        "requests_tried": sum(tally.values()),
        "answers": dict(sorted(tally.items())),
    }
    print(json.dumps(row, indent=1))
    atomic_write_json(a.json, row, indent=1)
    return 0 if row["job_exit_code"] == 0 and row["final_states_equal"] and not fails else 1


def _poll(port: int, stop: Any, out: Any) -> None:
    """`/status` of the training job every POLL_S until `stop`: (latencies, failures) to `out`."""
    lat, fails = [], 0
    while not stop.is_set():
        t = time.monotonic()
        code = _raw(port, _get("/status?job=bench", BENCH))
        lat.append(time.monotonic() - t)
        fails += code != "200"
        stop.wait(POLL_S)
    out.put((lat, fails))


def _still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
