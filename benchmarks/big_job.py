"""One job's size against another job's latency, on one standing lighthouse (issue #41, item 4).

    python benchmarks/big_job.py                        # this tree's ftcore, then 3ce79ea's
    python benchmarks/big_job.py --at HEAD~3 --groups 65535 --lines 200   # the most a job may declare

A real lighthouse process (loopback, a token file) serves job "big", whose ranks register one
group each over keep-alive heartbeat connections, and job "small", one real LighthouseClient
heartbeating every 50 ms. `--lines` of the big job's ranks each hold a heartbeat line of their
own; they all close at once, and for the next seconds a prober asks job "small"'s `/status`
back to back. Prints, per tree, the longest `/status` wait and the longest the small job's
client went unanswered (its `silent_for`), and writes bench-results/big_job.json.
"""

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftcore.lighthouse_client import LighthouseClient  # noqa: E402
from ftcore.messages import RankInfo  # noqa: E402

SECRET = "big-job-secret"
BASELINE = "3ce79ea"  # before the ticker-only sweeps (108fde5)


def _tree(at: str | None, tmp: Path) -> Path:
    """A folder holding ftcore: this checkout, or ftcore as of commit `at`."""
    if at is None:
        return ROOT
    archive = subprocess.run(["git", "archive", at, "ftcore"], cwd=ROOT, check=True, capture_output=True).stdout
    out = tmp / f"ftcore-{at}"
    out.mkdir()
    (tmp / "a.tar").write_bytes(archive)
    with tarfile.open(tmp / "a.tar") as t:
        t.extractall(out, filter="data")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tree: Path, tmp: Path) -> tuple[subprocess.Popen, str]:
    secret = tmp / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    addr = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, "-m", "ftcore.lighthouse", "--bind", addr, "--token-file", str(secret)]
    log = open(tmp / f"lighthouse-{tree.name}.log", "w")
    proc = subprocess.Popen(argv, env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(tuple(addr.split(":")), timeout=0.5).close()  # type: ignore[arg-type]
            return proc, addr
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"big_job: the lighthouse at {addr} did not start in 30 s (log: {log.name})")


def _beat(conn: http.client.HTTPConnection, g: int, groups: int) -> None:
    body = RankInfo(group=g, rank=0, world=1, job="big", num_groups=groups).to_wire()
    conn.request("POST", "/heartbeat", json.dumps(body).encode(), {"Authorization": f"Bearer {SECRET}"})
    resp = conn.getresponse()
    resp.read()
    if resp.status != 200:
        raise SystemExit(f"big_job: a heartbeat of group {g} got {resp.status}")


def _register(addr: str, groups: int, first: int, threads: int = 8) -> None:
    """Groups first..groups-1 of job "big", over `threads` keep-alive connections."""
    host, port = addr.split(":")

    def some(k: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        for g in range(first + k, groups, threads):
            _beat(conn, g, groups)
        conn.close()

    ts = [threading.Thread(target=some, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _status_waits(addr: str, seconds: float) -> list[float]:
    host, port = addr.split(":")
    waits, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.monotonic()
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("GET", "/status?job=small", headers={"Authorization": f"Bearer {SECRET}"})
        conn.getresponse().read()
        conn.close()
        waits.append(time.monotonic() - t)
    return waits


def measure(tree: Path, tmp: Path, groups: int, lines: int, seconds: float) -> dict:
    proc, addr = _start(tree, tmp)
    small = None
    try:
        host, port = addr.split(":")
        held = [http.client.HTTPConnection(host, int(port), timeout=30) for _ in range(lines)]
        for g, conn in enumerate(held):  # a line of its own for each of the first `lines` groups
            _beat(conn, g, groups)
        t = time.monotonic()
        _register(addr, groups, lines)
        registered_s = time.monotonic() - t
        small = LighthouseClient(addr, RankInfo(group=0, rank=0, world=1, job="small", num_groups=1), SECRET)
        small.start_heartbeats()
        time.sleep(2.0)
        silent, stop = [0.0], threading.Event()

        def watch() -> None:
            while not stop.wait(0.005):
                silent[0] = max(silent[0], small.silent_for())

        watcher = threading.Thread(target=watch)
        watcher.start()
        for conn in held:  # every line at once, as a rack of the big job going away
            conn.close()
        waits = _status_waits(addr, seconds)
        stop.set()
        watcher.join()
        return {
            "tree": tree.name if tree != ROOT else "this tree",
            "groups": groups,
            "lines_closed": lines,
            "register_s": round(registered_s, 2),
            "status_asked": len(waits),
            "status_max_ms": round(1000 * max(waits), 1),
            "small_silent_max_ms": round(1000 * silent[0], 1),
        }
    finally:
        if small is not None:
            small.close()
        proc.kill()
        proc.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=12000)
    ap.add_argument("--lines", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=5.0, help="how long /status is asked after the close")
    ap.add_argument("--at", default=BASELINE, help="the baseline commit whose ftcore runs second")
    ap.add_argument("--json", default=str(ROOT / "bench-results" / "big_job.json"))
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for at in (None, a.at):
            rows.append(measure(_tree(at, Path(d)), Path(d), a.groups, a.lines, a.seconds))
            if at is not None:
                rows[-1]["tree"] = at
    print("| ftcore | groups | lines closed | /status asked | /status max ms | small job unanswered max ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tree']} | {r['groups']} | {r['lines_closed']} | {r['status_asked']} | "
            f"{r['status_max_ms']} | {r['small_silent_max_ms']} |"
        )
    Path(a.json).parent.mkdir(exist_ok=True)
    Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
