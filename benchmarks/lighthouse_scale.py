"""The lighthouse under many ranks: quorum latency and lighthouse CPU per 1,000 ranks, up to 100,000 ranks.

    python benchmarks/lighthouse_scale.py [--ranks 1024 4096 16384 100000] [--group-size 8 64]
        [--layout relay rank] [--rounds 20] [--procs N] [--json PATH]

One real lighthouse process (`python -m ftcore.lighthouse`, loopback), pinned to one core, and
a load generator of N processes (asyncio each) on the other cores, each playing a slice of the
job's speakers. Layouts: `relay`, one speaker per replica group (ftcore/relay.py: one kept-alive
heartbeat line and one quorum connection per group, carrying its ranks' addresses), and `rank`,
every rank its own speaker (FTCORE_RELAY=0, the layout before relays). Every speaker heartbeats at
FTCORE_HEARTBEAT_INTERVAL (a relay: ftcore.relay.UPSTREAM_INTERVAL), or slower when the lighthouse
asks (its --heartbeat-budget), unless it sent a quorum request within that interval (as the
client does), and sends its addresses with a connection's first message. Reported per size and layout:

- heartbeats alone (2 s): lighthouse CPU seconds per wall second per 1,000 ranks;
- training rounds: every speaker asks for a quorum at once, as a job's step does; quorum latency
  from the moment the last request of a round was sent (the latest of all processes: one
  monotonic clock) to each reply, p50 and p99 over all speakers and rounds, and the
  lighthouse's CPU per 1,000 ranks;
- failure detection: one speaker's heartbeat connection closed -> a heartbeat reply names its group.

The rank layout at 16,384 ranks and beyond is skipped (`--layout rank` forces it): two
connections per rank and a heartbeat each every 50 ms is the load relays exist to remove.
"""

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftcore import timeouts  # noqa: E402
from ftcore.messages import Busy, Quorum, QuorumRequest, RankInfo  # noqa: E402
from ftcore.relay import UPSTREAM_INTERVAL  # noqa: E402
from ftcore.util.files import atomic_write_json  # noqa: E402
from ftcore.util.procs import free_port  # noqa: E402

IDLE_S = 2.0  # heartbeats alone, measured before the rounds
_SINK = object()  # a Conn's waiter when its reply goes to its sink


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Conn(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection that sends JSON POSTs and reads replies as they arrive
    (a protocol, not a stream: the generator's own cost per reply stays small beside the lighthouse's)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiter: Any = None  # a Future, or _SINK
        self.t: asyncio.Transport | None = None
        # a round's replies go to one sink, not a future each: no task wakes per reply, so the
        # generator reads every reply as it arrives (its lag is not counted as the lighthouse's)
        self.sink: Any = None

    @classmethod
    async def open(cls, port: int) -> "Conn":
        _, conn = await asyncio.get_running_loop().create_connection(cls, "127.0.0.1", port)
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("closed"))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None:
            return
        head = bytes(self.buf[:end]).lower()
        at = head.find(b"content-length:")
        length = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
        if len(self.buf) < end + 4 + length:
            return
        body = bytes(self.buf[end + 4 : end + 4 + length])
        del self.buf[: end + 4 + length]
        waiter, self.waiter = self.waiter, None
        if waiter is _SINK:
            return self.sink(int(head[9:12]), time.monotonic(), body)
        waiter.set_result((int(head[9:12]), body, time.monotonic()))

    def send(self, path: str, body: dict) -> None:
        """A POST whose reply goes to `self.sink(status, when its last byte was read, body)`."""
        assert self.t is not None
        raw = json.dumps(body).encode()
        self.waiter = _SINK
        self.t.write(f"POST {path} HTTP/1.1\r\nHost: lh\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)

    async def post(self, path: str, body: dict) -> tuple[int, dict, float]:
        """(status, the JSON reply, when its last byte was read)."""
        assert self.t is not None
        raw = json.dumps(body).encode()
        self.waiter = asyncio.get_running_loop().create_future()
        self.t.write(f"POST {path} HTTP/1.1\r\nHost: lh\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
        status, reply, at = await self.waiter
        return status, json.loads(reply) if reply else {}, at

    def close(self) -> None:
        if self.t is not None:
            self.t.close()


def _speakers(layout: str, n: int, k: int, job: str) -> list[dict[str, Any]]:
    """What every speaker sends: a group's relay (its K ranks' addresses) or each rank."""
    groups = n // k
    stores = ",".join(f"127.0.0.1:{1000 + r}" for r in range(k))
    heals = ",".join(f"127.0.0.1:{2000 + r}" for r in range(k))
    common = {"job": job, "world": k, "incarnation": 0, "num_groups": groups, "step": 0, "quorum_id": 0}
    if layout == "relay":
        return [{**common, "group": g, "rank": 0, "relay": True, "store": stores, "heal": heals} for g in range(groups)]
    return [
        {**common, "group": g, "rank": r, "store": f"127.0.0.1:{1000 + r}", "heal": f"127.0.0.1:{2000 + r}"}
        for g in range(groups)
        for r in range(k)
    ]


class _Round:
    """One round's replies: when each arrived (NaN: not a quorum), and the first one's body."""

    def __init__(self, n: int) -> None:
        self.n, self.first = n, b""
        self.arrived: list[float] = []
        self.done = asyncio.get_running_loop().create_future()

    def __call__(self, code: int, at: float, body: bytes) -> None:
        self.arrived.append(at if code == 200 else float("nan"))
        self.first = self.first or body
        if len(self.arrived) == self.n:
            self.done.set_result(None)


def _request(info: dict[str, Any], step: int, trained_in: dict[str, Any]) -> dict[str, Any]:
    """What a speaker's quorum request carries after a round, as ftcore's manager sends it: the
    quorum it trained in (by name) and its ranks' compute in that step (a relay: each rank's)."""
    busy = None
    if trained_in:
        each = [0.5] * (info["world"] if info.get("relay") else 1)
        busy = Busy(trained_in["quorum_id"], 0.5, tuple(each) if info.get("relay") else ())
    ask = QuorumRequest(
        RankInfo.parse({**info, "step": step, "quorum_id": trained_in.get("quorum_id", 0)}),
        quorum_lighthouse_id=trained_in.get("lighthouse_id", ""),
        quorum_key=trained_in.get("key", ""),
        busy=busy,
        timeout=10.0,
    )
    return ask.to_wire()


def _trained_in(reply: bytes) -> dict[str, Any]:
    q = Quorum.parse(json.loads(reply))
    return {"quorum_id": q.quorum_id, "lighthouse_id": q.lighthouse_id, "key": q.members_key}


async def _play(port: int, infos: list[dict[str, Any]], plan: dict[str, Any], stop: Any, out: Any) -> None:
    """One load-generator process: its speakers' heartbeats, then `rounds` quorum rounds."""
    beats = [await Conn.open(port) for _ in infos]
    quorum = [await Conn.open(port) for _ in infos]
    last_sent = [0.0] * len(infos)
    failed_seen: dict[int, float] = {}
    interval = UPSTREAM_INTERVAL if infos and infos[0].get("relay") else timeouts.HEARTBEAT_INTERVAL
    # as ftcore.lighthouse_client does: addresses go with a connection's first message only
    light = [{**info, "store": "", "heal": ""} for info in infos]
    asked = [False] * len(infos)

    async def heartbeat(i: int) -> None:
        await asyncio.sleep(interval * i / len(infos))  # phases spread, as independent processes are
        first, pace = True, interval
        while not stop.is_set():
            quiet = last_sent[i] + pace - time.monotonic()
            if not first and quiet > 0:
                await asyncio.sleep(quiet)
                continue
            first_beat, first = first, False
            try:
                code, body, _ = await beats[i].post("/heartbeat", infos[i] if first_beat else light[i])
            except (ConnectionError, asyncio.IncompleteReadError, ValueError):
                return
            for g in body.get("failed", []) if code == 200 else []:
                failed_seen.setdefault(g, time.monotonic())
            pace = max(interval, body.get("beat_s", 0.0))  # a loaded lighthouse asks for slower beats
            await asyncio.sleep(pace)

    tasks = [asyncio.create_task(heartbeat(i)) for i in range(len(infos))]
    await asyncio.sleep(max(plan["rounds_at"] - time.monotonic(), 0))

    rounds: list = []
    trained_in: dict[str, Any] = {}
    for _ in range(plan["rounds"]):
        got = _Round(len(infos))
        for i in range(len(infos)):
            last_sent[i] = time.monotonic()
            quorum[i].sink = got
            quorum[i].send("/quorum", _request(light[i] if asked[i] else infos[i], infos[i]["step"], trained_in))
            asked[i] = True
        sent = time.monotonic()  # every request written
        await got.done
        rounds.append((sent, got.arrived))
        trained_in = _trained_in(got.first)
        for info in infos:
            info["step"] += 1
        await asyncio.sleep(0.02)
    detect = float("nan")
    if plan["detect"]:  # this process holds group 0: its first speaker's line closes
        await asyncio.sleep(0.2)
        tasks[0].cancel()
        t_kill = time.monotonic()
        beats[0].close()
        while 0 not in failed_seen and time.monotonic() - t_kill < 5:
            await asyncio.sleep(0.002)
        detect = failed_seen.get(0, float("nan")) - t_kill
    out.put({"rounds": rounds, "detect": detect})
    while not stop.is_set():  # heartbeats go on until every process is done
        await asyncio.sleep(0.05)
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in beats + quorum:
        c.close()


def _worker(port: int, infos: list[dict[str, Any]], plan: dict[str, Any], stop: Any, out: Any, cores: Any) -> None:
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        asyncio.run(asyncio.wait_for(_play(port, infos, plan, stop, out), plan["limit_s"]))
    except BaseException as e:  # the parent reports it; never hang it
        out.put({"error": f"{type(e).__name__}: {e}"})


def run_size(layout: str, n: int, k: int, port: int, a: argparse.Namespace, gen_cores: Any) -> dict[str, Any]:
    infos = _speakers(layout, n, k, f"bench-{layout}-{n}-{k}")
    procs = max(1, min(a.procs, len(infos)))
    now = time.monotonic()
    connect_s = 2.0 + len(infos) / 2000  # every speaker connected and heartbeating
    plan = {"rounds": a.rounds, "rounds_at": now + connect_s + IDLE_S, "detect": False, "limit_s": 900}
    ctx = mp.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    workers = []
    for p in range(procs):
        part = {**plan, "detect": p == 0}
        w = ctx.Process(target=_worker, args=(port, infos[p::procs], part, stop, out, gen_cores), daemon=True)
        w.start()
        workers.append(w)
    time.sleep(max(plan["rounds_at"] - IDLE_S - time.monotonic(), 0))
    cpu0, t0 = _cpu_seconds(LH_PID), time.monotonic()
    time.sleep(IDLE_S)
    idle_cpu = (_cpu_seconds(LH_PID) - cpu0) / (time.monotonic() - t0)
    cpu0, t0 = _cpu_seconds(LH_PID), time.monotonic()
    results: list[dict[str, Any]] = []
    try:
        while len(results) < procs:
            results.append(out.get(timeout=max(plan["limit_s"] - (time.monotonic() - now), 1)))
    except queue.Empty:
        raise SystemExit(f"{layout} {n} ranks: the load generator did not finish") from None
    finally:
        rounds_cpu = (_cpu_seconds(LH_PID) - cpu0) / (time.monotonic() - t0)
        stop.set()
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise SystemExit(f"{layout} {n} ranks: {errors[0]}")
    return _row(layout, n, k, len(infos), results, idle_cpu, rounds_cpu)


def _row(layout: str, n: int, k: int, speakers: int, results: list, idle_cpu: float, rounds_cpu: float) -> dict:
    latencies: list[float] = []
    rounds = len(results[0]["rounds"])
    for i in range(rounds):
        last_sent = max(r["rounds"][i][0] for r in results)  # one clock: CLOCK_MONOTONIC is system-wide
        latencies += [t - last_sent for r in results for t in r["rounds"][i][1]]
    ok = sorted(x for x in latencies if x == x)
    detect = next(r["detect"] for r in results if r["detect"] == r["detect"]) if results else float("nan")
    return {
        "layout": layout,
        "ranks": n,
        "group_size": k,
        "speakers": speakers,
        "heartbeat_cpu_per_1000_ranks": round(idle_cpu / (n / 1000), 4),
        "rounds": rounds,
        "quorum_p50_ms": round(1000 * statistics.median(ok), 2) if ok else None,
        "quorum_p99_ms": round(1000 * ok[int(0.99 * (len(ok) - 1))], 2) if ok else None,
        "failed_requests": len(latencies) - len(ok),
        "rounds_cpu_per_1000_ranks": round(rounds_cpu / (n / 1000), 4),
        "failure_detection_ms": round(1000 * detect, 1),
    }


LH_PID = 0


def _start_lighthouse(root: Path, port: int, cores: set[int] | None) -> subprocess.Popen:
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
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
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


def _pin() -> tuple[set[int] | None, set[int] | None]:
    """The lighthouse on one core and the load generator on the others (where there are two)."""
    cores = sorted(os.sched_getaffinity(0))
    return ({cores[0]}, set(cores[1:])) if len(cores) > 1 else (None, None)


def _runs(a: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(layout, ranks, group size) in order; the rank layout stops at 4,096 ranks unless asked for alone."""
    runs = []
    for n in a.ranks:
        for layout in a.layout:
            if layout == "rank":
                if n <= 4096 or a.layout == ["rank"]:
                    runs.append((layout, n, a.group_size[0]))
                continue
            runs += [(layout, n, k) for k in a.group_size if k <= n]
    return runs


def main() -> int:
    global LH_PID
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384, 100000])
    p.add_argument("--group-size", type=int, nargs="+", default=[8, 64], help="ranks per replica group")
    p.add_argument("--layout", nargs="+", choices=("relay", "rank"), default=["relay", "rank"])
    p.add_argument("--rounds", type=int, default=20, help="quorum rounds per size")
    p.add_argument("--procs", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1), help="load generators")
    p.add_argument(
        "--peer-root",
        type=Path,
        help="another checkout of ftrec (e.g. `git worktree add /tmp/old REV`): each rank-layout size runs "
        "against its lighthouse too, and the table gets the ratios",
    )
    p.add_argument("--json", default=str(ROOT / "bench-results" / "lighthouse_scale.json"))
    a = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still ends its lighthouse
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    lh_cores, gen_cores = _pin()
    rows = []
    fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    for layout, n, k in _runs(a):
        speakers = n // k if layout == "relay" else n
        if 2 * speakers + 64 > fds:  # each speaker's heartbeat and quorum connections, in one generator
            print(f"skipped: {layout} {n} ranks in groups of {k}: {2 * speakers} sockets, {fds} open files allowed")
            continue
        roots = [("this", ROOT)] + ([("peer", a.peer_root.resolve())] if a.peer_root and layout == "rank" else [])
        for name, root in roots:
            port = free_port()
            lh = _start_lighthouse(root, port, lh_cores)
            LH_PID = lh.pid
            try:
                row = run_size(layout, n, k, port, a, gen_cores)
            finally:
                lh.kill()
                lh.wait()
            rows.append({"lighthouse": name, **row})
            print(json.dumps(rows[-1]), flush=True)
    _print(rows, bool(a.peer_root))
    meta = {
        "heartbeat_interval_s": timeouts.HEARTBEAT_INTERVAL,
        "relay_interval_s": UPSTREAM_INTERVAL,
        "procs": a.procs,
        "pinned": lh_cores is not None,
    }
    atomic_write_json(a.json, {**meta, "rows": rows}, indent=1)
    return 0


def _print(rows: list[dict[str, Any]], peers: bool) -> None:
    cols = list(rows[0]) if rows else []
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    by = {(r["lighthouse"], r["layout"], r["ranks"], r["group_size"]): r for r in rows}
    print("\n| ranks | group size | quorum p99, relay / rank layout | lighthouse CPU in rounds, relay / rank |")
    print("|---|---|---|---|")
    for (who, layout, n, k), r in by.items():
        base = next((b for (w, lay, m, _), b in by.items() if (w, lay, m) == ("this", "rank", n)), None)
        if who == "this" and layout == "relay" and base and r["quorum_p99_ms"] and base["quorum_p99_ms"]:
            p99 = r["quorum_p99_ms"] / base["quorum_p99_ms"]
            cpu = r["rounds_cpu_per_1000_ranks"] / max(base["rounds_cpu_per_1000_ranks"], 1e-9)
            print(f"| {n} | {k} | {p99:.2f} | {cpu:.2f} |")
    if peers:
        print("\n| ranks | quorum p99 this/peer (rank layout) |\n|---|---|")
        for (who, layout, n, k), r in by.items():
            peer = by.get(("peer", layout, n, k))
            if who == "this" and peer and r["quorum_p99_ms"] and peer["quorum_p99_ms"]:
                print(f"| {n} | {r['quorum_p99_ms'] / peer['quorum_p99_ms']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
