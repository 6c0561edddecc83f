"""The lighthouse under many ranks: heartbeat throughput, quorum latency, CPU per 1,000 ranks.

    python benchmarks/lighthouse_scale.py [--ranks 64 256 1024 4096] [--seconds 8] [--json PATH]

One real lighthouse process (`python -m ftcore.lighthouse`, loopback) and, in this process,
a load generator of simulated ranks (asyncio, one kept-alive heartbeat connection and one
quorum connection per rank, as ftcore.lighthouse_client keeps them), in groups of 8 ranks.
Every rank heartbeats at FTCORE_HEARTBEAT_INTERVAL; every round all ranks ask for a quorum
at once, as a job's step does. Reported per size:

- heartbeats alone (3 s, ranks between steps): served per second, offered (ranks / interval),
  lighthouse CPU seconds per wall second per 1,000 ranks (from /proc/<pid>/stat);
- training rounds: every rank asks for a quorum at once, as a job's step does, and
  heartbeats when no request went out within the interval (as the real client does);
  requests/s served, and quorum latency from the moment the last rank of a round has sent
  its request to each rank's reply (formation and delivery), p50 and p99 over all ranks and
  rounds, and the lighthouse's CPU per 1,000 ranks;
- failure detection: one rank's heartbeat connection closed -> the lighthouse's heartbeat
  replies name its group as failed.

Both sides share this machine's cores, so the generator's own CPU limits what is offered.
"""

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dataprep.fsutil import atomic_write_json  # noqa: E402
from ftcore import timeouts  # noqa: E402
from training.ports import free_port  # noqa: E402

K = 8  # ranks per simulated replica group


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Conn:
    """One kept-alive HTTP/1.1 connection that sends JSON POSTs and reads JSON replies."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.r, self.w = reader, writer

    @classmethod
    async def open(cls, port: int) -> "Conn":
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def post(self, path: str, body: dict, decode: bool = True) -> tuple[int, dict]:
        """decode=False: the reply is read whole but not parsed (a real rank parses its own in
        its own process; here one process plays them all)."""
        raw = json.dumps(body).encode()
        self.w.write(
            f"POST {path} HTTP/1.1\r\nHost: lh\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        status = int((await self.r.readline()).split()[1])
        length = 0
        while (line := await self.r.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        raw = await self.r.readexactly(length) if length else b""
        return status, json.loads(raw) if raw and decode else {}

    def close(self) -> None:
        self.w.close()


async def run_size(n: int, port: int, seconds: float, job: str) -> dict:
    groups = n // K
    infos: list[dict[str, Any]] = [
        {
            "job": job,
            "group": g,
            "rank": k,
            "world": K,
            "incarnation": 0,
            "num_groups": groups,
            "step": 0,
            "quorum_id": 0,
            "store": f"127.0.0.1:{1000 + k}",
            "heal": f"127.0.0.1:{2000 + k}",
        }
        for g in range(groups)
        for k in range(K)
    ]
    beats = [await Conn.open(port) for _ in infos]
    quorum = [await Conn.open(port) for _ in infos]
    served = 0
    last_sent = [0.0] * len(infos)
    stop = asyncio.Event()
    failed_seen: dict[int, float] = {}

    async def heartbeat(i: int) -> None:
        nonlocal served
        # spread the ranks' phases over one interval, as independent processes are
        await asyncio.sleep(timeouts.HEARTBEAT_INTERVAL * i / len(infos))
        first = True
        while not stop.is_set():
            # as ftcore.lighthouse_client does: no beat within an interval of a quorum request
            quiet = last_sent[i] + timeouts.HEARTBEAT_INTERVAL - time.monotonic()
            if not first and quiet > 0:
                await asyncio.sleep(quiet)
                continue
            first = False
            try:
                code, body = await beats[i].post("/heartbeat", infos[i])
            except (ConnectionError, asyncio.IncompleteReadError, ValueError):
                return
            if code == 200:
                served += 1
                for g in body.get("failed", []):
                    failed_seen.setdefault(g, time.monotonic())
            await asyncio.sleep(timeouts.HEARTBEAT_INTERVAL)

    tasks = [asyncio.create_task(heartbeat(i)) for i in range(len(infos))]
    await asyncio.sleep(1.0)  # every rank registered and heartbeating
    # phase 1: heartbeats alone (ranks between steps, or in a long step)
    cpu0, t0, served0 = _cpu_seconds(LH_PID), time.monotonic(), served
    await asyncio.sleep(min(3.0, seconds))
    idle_wall = time.monotonic() - t0
    idle_cpu, idle_rate = _cpu_seconds(LH_PID) - cpu0, (served - served0) / idle_wall

    async def ask(i: int, sent: list[float], got: list[float]) -> None:
        last_sent[i] = time.monotonic()
        code, _ = await quorum[i].post("/quorum", {**infos[i], "timeout": 10.0}, decode=False)
        got[i] = time.monotonic() if code == 200 else float("nan")

    # phase 2: every rank asks for a quorum each step, heartbeating when a step is long
    latencies: list[float] = []
    rounds = 0
    cpu0, t0, served0 = _cpu_seconds(LH_PID), time.monotonic(), served
    while time.monotonic() - t0 < seconds:
        got = [0.0] * len(infos)
        sent: list[float] = []
        round_tasks = [asyncio.create_task(ask(i, sent, got)) for i in range(len(infos))]
        await asyncio.sleep(0)  # every request written before the clock starts
        round_sent = time.monotonic()
        await asyncio.gather(*round_tasks)
        latencies += [g - round_sent for g in got]
        rounds += 1
        for info in infos:
            info["step"] += 1
        await asyncio.sleep(0.02)
    wall = time.monotonic() - t0
    cpu = _cpu_seconds(LH_PID) - cpu0
    req_rate = (served - served0 + rounds * len(infos)) / wall

    # failure detection: group 0's rank 0 dies (its heartbeat connection closes)
    tasks[0].cancel()
    t_kill = time.monotonic()
    beats[0].close()
    while 0 not in failed_seen and time.monotonic() - t_kill < 5:
        await asyncio.sleep(0.002)
    detect = failed_seen.get(0, float("nan")) - t_kill
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in beats + quorum:
        c.close()
    ok = [x for x in latencies if x == x]
    ok.sort()
    return {
        "ranks": n,
        "groups": groups,
        "heartbeats_per_s": round(idle_rate),
        "offered_per_s": round(n / timeouts.HEARTBEAT_INTERVAL),
        "heartbeat_cpu_per_1000_ranks": round(idle_cpu / idle_wall / (n / 1000), 3),
        "rounds": rounds,
        "requests_per_s": round(req_rate),
        "quorum_p50_ms": round(1000 * statistics.median(ok), 2) if ok else None,
        "quorum_p99_ms": round(1000 * ok[int(0.99 * (len(ok) - 1))], 2) if ok else None,
        "failed_requests": len(latencies) - len(ok),
        "training_cpu_per_1000_ranks": round(cpu / wall / (n / 1000), 3),
        "failure_detection_ms": round(1000 * detect, 1),
    }


LH_PID = 0


def _start_lighthouse(root: Path, port: int) -> subprocess.Popen:
    # every simulated host shares 127.0.0.1 here: the per-address caps are a real host's times 1,000
    caps = ["--max-connections-per-peer", "65536", "--max-unauthenticated-per-peer", "65536"]
    old = "max-unauthenticated-per-peer" not in (root / "ftcore" / "lighthouse.py").read_text()
    lh = subprocess.Popen(
        [sys.executable, "-m", "ftcore.lighthouse", "--bind", f"127.0.0.1:{port}", "--insecure"]
        + ([] if old else caps),
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return lh
        except OSError:
            if time.monotonic() > deadline or lh.poll() is not None:
                lh.kill()
                raise SystemExit("the lighthouse did not start") from None
            time.sleep(0.1)


def main() -> int:
    global LH_PID
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096])
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per size")
    p.add_argument(
        "--peer-root",
        type=Path,
        help="another checkout of ftrec (e.g. `git worktree add /tmp/old REV`): each size runs against its "
        "lighthouse too, interleaved, and the table gets the ratios",
    )
    p.add_argument("--json", default=str(ROOT / "bench-results" / "lighthouse_scale.json"))
    a = p.parse_args()
    roots = [("this", ROOT)] + ([("peer", a.peer_root.resolve())] if a.peer_root else [])
    rows = []
    for n in a.ranks:
        for name, root in roots:
            port = free_port()
            lh = _start_lighthouse(root, port)
            LH_PID = lh.pid
            try:
                row = asyncio.run(asyncio.wait_for(run_size(n, port, a.seconds, f"bench-{n}"), a.seconds + 120))
            finally:
                lh.kill()
                lh.wait()
            rows.append({"lighthouse": name, **row})
            print(json.dumps(rows[-1]), flush=True)
    cols = list(rows[0]) if rows else []
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if a.peer_root:
        print("\n| ranks | quorum p99 this/peer | CPU per 1,000 ranks in rounds, this/peer |\n|---|---|---|")
        for this, peer in zip(rows[::2], rows[1::2], strict=True):
            p99 = (
                this["quorum_p99_ms"] / peer["quorum_p99_ms"]
                if this["quorum_p99_ms"] and peer["quorum_p99_ms"]
                else None
            )
            cpu = this["training_cpu_per_1000_ranks"] / max(peer["training_cpu_per_1000_ranks"], 1e-9)
            print(f"| {this['ranks']} | {p99:.2f} | {cpu:.2f} |" if p99 else f"| {this['ranks']} | - | {cpu:.2f} |")
    atomic_write_json(a.json, {"heartbeat_interval_s": timeouts.HEARTBEAT_INTERVAL, "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
