"""The lighthouse under abuse while a real job trains against it.

    python benchmarks/lighthouse_abuse.py [--json PATH]

One standing lighthouse (`python -m ftcore.lighthouse`, token, loopback). A real 2-group job
(`python -m training launch --lighthouse ...`, the trainer on a small synthetic shard set)
trains against it while, bounded in count and time, this script sends it:

- malformed requests: garbage, non-UTF-8 bodies, `Infinity`, non-object JSON, a non-numeric
  Content-Length, bodies over 1 MiB;
- 1,000 concurrent connections without the token, and 200 idle sockets that never speak;
- a rank flood from a token holder: phantom groups beyond the job's, ranks beyond their world,
  and 2,000 heartbeats of a job of its own.

Reported: requests tried and how they were answered, the job's outcome (exit code, both groups'
final states equal), and `/status` latency throughout (p50, max, failures).
"""

import argparse
import json
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from training.ports import free_port  # noqa: E402

TOKEN = "abuse-bench-token"


def _raw(port: int, data: bytes, timeout: float = 5.0) -> str:
    """Send bytes on a fresh connection; the reply's status code, or what happened instead."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(data)
            head = s.recv(64)
            return head.split(b" ")[1].decode() if head.startswith(b"HTTP/1.1 ") else "closed"
    except OSError as e:
        return type(e).__name__


def _post(path: str, body: bytes, token: bool = True, length: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {TOKEN}\r\n" if token else ""
    return (f"POST {path} HTTP/1.1\r\nHost: lh\r\n{auth}Content-Length: {length or len(body)}\r\n\r\n").encode() + body


def abuse(port: int, stop: threading.Event, tally: Counter) -> None:
    malformed = [
        _post("/heartbeat", b"\xff\xfe\xfd"),
        _post("/heartbeat", b"Infinity"),
        _post("/quorum", b"[1,2]"),
        _post("/heartbeat", b"", length="abc"),
        _post("/heartbeat", b"x" * (2 << 20)),
        b"GARBAGE\r\n\r\n",
        _post("/heartbeat", b'{"group": 0, "rank": 5, "world": 2, "job": "bench"}'),
        _post("/heartbeat", b'{"group": 99, "rank": 0, "world": 1, "num_groups": 2, "job": "bench"}'),
        _post("/heartbeat", b'{"group": 0, "rank": 0, "quorum_id": 1e30, "job": "bench"}'),
    ]
    rounds = 0
    while not stop.is_set() and rounds < 40:
        rounds += 1
        for m in malformed:
            tally[f"malformed -> {_raw(port, m)}"] += 1
        # 1,000 concurrent connections without the token
        results: list[str] = []
        lock = threading.Lock()

        def one(results: list[str], lock: threading.Lock) -> None:
            r = _raw(port, b"GET /status HTTP/1.1\r\n\r\n", timeout=10)
            with lock:
                results.append(r)

        ts = [threading.Thread(target=one, args=(results, lock)) for _ in range(1000 if rounds == 1 else 100)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for r in results:
            tally[f"no token -> {r}"] += 1
        # a rank flood of a job of its own
        for i in range(50):
            body = json.dumps({"job": "flood", "group": i % 64, "rank": 0, "world": 1, "num_groups": 64}).encode()
            tally[f"flood heartbeat -> {_raw(port, _post('/heartbeat', body))}"] += 1
        stop.wait(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=str(ROOT / "bench-results" / "lighthouse_abuse.json"))
    a = p.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FTCORE_TOKEN": TOKEN}
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
            while _raw(port, b"GET /status HTTP/1.1\r\n\r\n") not in ("401", "200"):
                if time.monotonic() > deadline:
                    raise SystemExit("the lighthouse did not start")
                time.sleep(0.1)
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
            stop, tally = threading.Event(), Counter[str]()
            attacker = threading.Thread(target=abuse, args=(port, stop, tally))
            attacker.start()
            lat, fails = [], 0
            while job.poll() is None:
                t = time.monotonic()
                code = _raw(port, f"GET /status?job=bench HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
                lat.append(time.monotonic() - t)
                fails += code != "200"
                time.sleep(0.5)
            stop.set()
            attacker.join()
            assert job.stdout is not None  # stdout=PIPE
            log = job.stdout.read()
            sums = [line.split("checksum ")[1].split()[0] for line in log.splitlines() if " checksum " in line]
        finally:
            for s in idle:
                s.close()
            lh.kill()
            lh.wait()
    row = {
        "job_exit_code": job.returncode,
        "final_states_equal": len(sums) == 2 and len(set(sums)) == 1,
        "status_polls": len(lat),
        "status_failures": fails,
        "status_p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
        "status_max_ms": round(1000 * max(lat), 1) if lat else None,
        "requests_tried": sum(tally.values()),
        "answers": dict(sorted(tally.items())),
    }
    print(json.dumps(row, indent=1))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(row, indent=1))
    return 0 if row["job_exit_code"] == 0 and row["final_states_equal"] and not fails else 1


if __name__ == "__main__":
    sys.exit(main())
