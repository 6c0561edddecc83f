"""The lighthouse under many ranks: quorum latency and lighthouse CPU per 1,000 ranks, up to 100,000 ranks.

    python benchmarks/lighthouse_scale.py [--ranks 1024 4096 16384 100000] [--group-size 8 64]
        [--layout relay upstream rank] [--load quiet hog] [--hog-on any|lighthouse|generators]
        [--rounds 20] [--procs N] [--relay-max-groups 64] [--relay-max-ranks 1024] [--json PATH]

One real lighthouse process (`python -m ftcore.lighthouse`, loopback), pinned to one core, and
a load generator of N processes (asyncio each) on the other cores, each playing a slice of the
job's speakers. Layouts:

- `relay`: one real `ftcore.relay.Relay` per replica group (made as rank 0's manager makes it,
  in the generator processes), its K ranks played beside it: each rank opens its heartbeat line
  and quorum connection to its relay and beats every RANK_BEAT_S (a relay judges a rank by its
  line); the relays speak to the lighthouse. Run up to --relay-max-groups relays and
  --relay-max-ranks ranks (all in the generators, on one core here: beyond, they fall seconds
  behind and their relays are failed); larger sizes say so and are not run.
- `upstream`: one speaker per group sending what a relay sends upstream (one kept-alive line and
  one quorum connection, the group's addresses), written by this benchmark, not by ftcore.relay:
  the lighthouse's load at the sizes the real relays do not fit on this machine.
- `rank`: every rank its own speaker (FTCORE_RELAY=0, the layout before relays).

A speaker heartbeats at its interval (a rank: FTCORE_HEARTBEAT_INTERVAL, `upstream`:
ftcore.relay.UPSTREAM_INTERVAL), or slower when the lighthouse asks (its --heartbeat-budget),
unless it sent a quorum request within that interval (as the client does). Each size runs quiet
and beside a CPU hog (benchmarks/hog.py: one busy loop, on the core --hog-on names), in turn.
Reported per size, layout and load:

- heartbeats alone (2 s): lighthouse CPU seconds per wall second per 1,000 ranks;
- heartbeat p99: a speaker's beat to its answer (a rank's: by its relay);
- training rounds: every speaker asks for a quorum at once, as a job's step does; quorum latency
  from the moment the last request of a round was sent (the latest of all processes: one
  monotonic clock) to each reply, p50 and p99 over all speakers and rounds, and the
  lighthouse's CPU per 1,000 ranks; the generators' own worst lateness (a late generator makes
  its speakers late);
- failure detection: group 0's line closed (a rank's, in `relay`) -> the lighthouse's
  `failure_detected` for it (its events file);
- false failures: any other `failure_detected` before the speakers hang up (a group not killed,
  or group 0 before its kill). Any makes the run exit 1; none is ever shown as a detection time.

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
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import hog, verdicts  # noqa: E402
from ftcore import timeouts  # noqa: E402
from ftcore.messages import Busy, Quorum, QuorumRequest, RankInfo  # noqa: E402
from ftcore.relay import UPSTREAM_INTERVAL, Relay  # noqa: E402
from ftcore.util.files import atomic_write_json  # noqa: E402
from ftcore.util.procs import free_port  # noqa: E402

IDLE_S = 2.0  # heartbeats alone, measured before the rounds
DETECT_WAIT_S = 5.0  # how long after the kill a verdict against the killed group is awaited
LAYOUTS = ("relay", "upstream", "rank")
# A relay judges its ranks by their lines, not by their beats; the ranks beside the real relays
# beat this often (not every 50 ms) so that their generator keeps up on this machine.
RANK_BEAT_S = 1.0
BEATS_KEPT = 50_000  # heartbeat round trips each generator reports (its last)
RELAYS_PER_PROC = 800  # each takes a low file descriptor (see _worker)
# the real relays, their ranks beside them, in the generators on one core of this 2-core machine: at
# 128 relays (1,024 ranks in groups of 8) a generator falls 0.6 s behind and its relays are failed
RELAY_MAX_GROUPS = 64
# ... and at 4,096 ranks (64 relays of 64) the generators fell 1.4-3 s behind quiet, 14 s beside a hog
RELAY_MAX_RANKS = 1024
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
        if self.waiter not in (None, _SINK) and not self.waiter.done():
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
        if not waiter.done():  # not cancelled (the run ends)
            waiter.set_result((int(head[9:12]), body, time.monotonic()))

    def send(self, path: str, raw: bytes) -> None:
        """A POST of JSON `raw` whose reply goes to `self.sink(status, when its last byte was read, body)`."""
        assert self.t is not None
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
    """What every speaker sends: each rank (to its group's relay in `relay`, to the lighthouse in
    `rank`), or a group's relay upstream message as this benchmark writes it (`upstream`)."""
    groups = n // k
    stores = ",".join(f"127.0.0.1:{1000 + r}" for r in range(k))
    heals = ",".join(f"127.0.0.1:{2000 + r}" for r in range(k))
    common = {"job": job, "world": k, "incarnation": 0, "num_groups": groups, "step": 0, "quorum_id": 0}
    if layout == "upstream":
        return [{**common, "group": g, "rank": 0, "relay": True, "store": stores, "heal": heals} for g in range(groups)]
    return [
        {**common, "group": g, "rank": r, "store": f"127.0.0.1:{1000 + r}", "heal": f"127.0.0.1:{2000 + r}"}
        for g in range(groups)
        for r in range(k)
    ]


def _slices(layout: str, infos: list[dict[str, Any]], procs: int) -> list[list[dict[str, Any]]]:
    """The speakers of each load generator; a relay's ranks all in one (its relay lives there)."""
    if layout != "relay":
        return [infos[p::procs] for p in range(procs)]
    return [[i for i in infos if i["group"] % procs == p] for p in range(procs)]


def _generators(layout: str, n: int, k: int, asked: int) -> int:
    """Load-generator processes: as asked, or more where one would hold more sockets than it may
    open (a relay's ranks: four sockets each, both ends of two connections)."""
    per_speaker = 4 if layout == "relay" else 2
    speakers = n // k if layout == "upstream" else n
    fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    need = max(asked, -(-(per_speaker * speakers + 8 * (n // k)) // int(0.8 * fds)))
    return max(need, -(-(n // k) // RELAYS_PER_PROC)) if layout == "relay" else need


class _Round:
    """One round's replies: when each arrived (NaN: not a quorum), and the first one's body."""

    def __init__(self, n: int) -> None:
        self.n, self.first = n, b""
        self.arrived: list[float] = []
        self.done = asyncio.get_running_loop().create_future()

    def __call__(self, code: int, at: float, body: bytes) -> None:
        quorum = code == 200 and b'"members_key"' in body  # not a refusal, nor a standby
        self.arrived.append(at if quorum else float("nan"))
        self.first = self.first or (body if quorum else b"")
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


async def _play(ports: list[int], infos: list[dict[str, Any]], plan: dict[str, Any], stop: Any, out: Any) -> None:
    """One load-generator process: its speakers' heartbeats, then `rounds` quorum rounds
    (speaker i speaks to ports[i]: the lighthouse, or its group's relay)."""
    beats, quorum = [], []
    for p in ports:  # a speaker's two connections together: a relay evicts lines that stay mute
        beats.append(await Conn.open(p))
        quorum.append(await Conn.open(p))
    last_sent = [0.0] * len(infos)
    interval = plan["interval"]
    # as ftcore.lighthouse_client does: addresses go with a connection's first message only
    light = [{**info, "store": "", "heal": ""} for info in infos]
    beat_rtt: list[float] = []

    async def heartbeat(i: int) -> None:
        await asyncio.sleep(interval * i / len(infos))  # phases spread, as independent processes are
        first, pace = True, interval
        while not stop.is_set():
            quiet = last_sent[i] + pace - time.monotonic()
            if not first and quiet > 0:
                await asyncio.sleep(quiet)
                continue
            first_beat, first = first, False
            t = time.monotonic()
            try:
                code, body, at = await beats[i].post("/heartbeat", infos[i] if first_beat else light[i])
            except (ConnectionError, asyncio.IncompleteReadError, ValueError):
                return
            if t >= plan["rounds_at"] - IDLE_S:  # every speaker connected: a beat's round trip
                beat_rtt.append(at - t)
            pace = max(interval, body.get("beat_s", 0.0))  # a loaded lighthouse asks for slower beats
            await asyncio.sleep(pace)

    tasks = [asyncio.create_task(heartbeat(i)) for i in range(len(infos))]
    lag = [0.0]
    tasks.append(asyncio.create_task(_lag(lag, plan["rounds_at"] - IDLE_S, stop)))
    await asyncio.sleep(max(plan["rounds_at"] - time.monotonic(), 0))
    for fd in plan.get("spare_fds", ()):
        os.close(fd)

    rounds = await _ask_rounds(plan["rounds"], infos, quorum, last_sent)
    killed_at = None
    if plan["detect"]:  # this process holds group 0: its first speaker's line closes (the lighthouse
        await asyncio.sleep(0.2)  # logs its verdict; the run judges it from the events file)
        tasks[0].cancel()
        killed_at = time.time()
        beats[0].close()
        await asyncio.sleep(DETECT_WAIT_S)
    out.put({"rounds": rounds, "killed_at": killed_at, "beat_rtt": beat_rtt[-BEATS_KEPT:], "lag": lag[0]})
    while not stop.is_set():  # heartbeats go on until every process is done
        await asyncio.sleep(0.05)
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in beats + quorum:
        c.close()


async def _ask_rounds(n: int, infos: list[dict[str, Any]], quorum: list[Conn], last_sent: list[float]) -> list:
    """`n` rounds: every speaker asks, the next round once all were answered; per round, when
    its last request was written and when each reply arrived."""
    rounds: list = []
    trained_in: dict[str, Any] = {}
    light = [{**info, "store": "", "heal": ""} for info in infos]  # a connection's later messages
    for r in range(n):
        # each speaker's request made first, then all written at once: in a job every group asks
        # from its own process; one generator playing thousands must not spread the burst
        asks = []
        for i in range(len(infos)):
            asks.append(json.dumps(_request(light[i] if r else infos[i], infos[i]["step"], trained_in)).encode())
            if i % 256 == 255:
                await asyncio.sleep(0)  # the heartbeats go on meanwhile
        got = _Round(len(infos))
        for i in range(len(infos)):
            last_sent[i] = time.monotonic()
            quorum[i].sink = got
            quorum[i].send("/quorum", asks[i])
        sent = time.monotonic()  # every request written
        await got.done
        rounds.append((sent, got.arrived))
        trained_in = _trained_in(got.first) if got.first else {}
        for info in infos:
            info["step"] += 1
        await asyncio.sleep(0.02)
    return rounds


async def _lag(worst: list[float], since: float, stop: Any) -> None:
    """The generator's own lateness: how much later than asked its loop wakes, at worst (from
    `since`). A generator late by a failure probe makes its speakers late to the lighthouse."""
    while not stop.is_set():
        t = time.monotonic()
        await asyncio.sleep(0.01)
        if t >= since:
            worst[0] = max(worst[0], time.monotonic() - t - 0.01)


def _relays(port: int, infos: list[dict[str, Any]]) -> tuple[list[Relay], list[int]]:
    """One real ftcore.relay.Relay per group of these ranks, made as rank 0's manager makes it
    (its registration, the lighthouse's address); and the port each rank speaks to."""
    relays: dict[int, Relay] = {}
    ports = []
    for info in infos:
        g = info["group"]
        if g not in relays:
            relays[g] = relay = Relay(f"127.0.0.1:{port}", RankInfo.parse({**info, "rank": 0}), None, "127.0.0.1")
            # its K ranks all share 127.0.0.1 here (a host's 8 in a job): none is a stranger to evict
            relay.cfg.max_unauthenticated_per_peer = relay.cfg.max_connections_per_peer
        ports.append(int(relays[g].address.rsplit(":", 1)[1]))
    return list(relays.values()), ports


def _worker(port: int, infos: list[dict[str, Any]], plan: dict[str, Any], stop: Any, out: Any, cores: Any) -> None:
    if cores:
        os.sched_setaffinity(0, cores)
    relays: list[Relay] = []
    try:
        ports = [port] * len(infos)
        if plan["layout"] == "relay":
            relays, ports = _relays(port, infos)
        # the relays' upstream quorum connections open at the first round, after thousands of the
        # ranks' sockets; ftcore.lighthouse_client waits on them with select(), which takes fds
        # below 1024 only: these are kept free for them until then (a relay's own process holds few)
        plan = {**plan, "spare_fds": [os.open(os.devnull, os.O_RDONLY) for _ in relays]}
        asyncio.run(asyncio.wait_for(_play(ports, infos, plan, stop, out), plan["limit_s"]))
    except BaseException as e:  # the parent reports it; never hang it
        out.put({"error": f"{type(e).__name__}: {e}"})
    for r in relays:
        r.close()


def run_size(layout: str, n: int, k: int, port: int, a: argparse.Namespace, gen_cores: Any) -> dict[str, Any]:
    """One size under the lighthouse at `port`: the generators' results and the lighthouse's CPU."""
    infos = _speakers(layout, n, k, f"bench-{layout}-{n}-{k}")
    procs = min(_generators(layout, n, k, a.procs), len(infos))
    now = time.monotonic()
    connect_s = 2.0 + len(infos) / 2000 + (n // k / 200 if layout == "relay" else 0)  # every speaker beating
    interval = {"relay": RANK_BEAT_S, "upstream": UPSTREAM_INTERVAL}.get(layout, timeouts.HEARTBEAT_INTERVAL)
    plan = {"rounds": a.rounds, "rounds_at": now + connect_s + IDLE_S, "limit_s": 900}
    plan |= {"layout": layout, "interval": interval}
    ctx = mp.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    workers = []
    for i, part in enumerate(_slices(layout, infos, procs)):
        w = ctx.Process(
            target=_worker, args=(port, part, {**plan, "detect": i == 0}, stop, out, gen_cores), daemon=True
        )
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
        ended = time.time()  # the speakers hang up from now: the lighthouse's verdicts after are not judged
        stop.set()
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise SystemExit(f"{layout} {n} ranks: {errors[0]}")
    return {"speakers": len(infos), "results": results, "idle_cpu": idle_cpu, "rounds_cpu": rounds_cpu, "ended": ended}


def _p99(xs: list[float]) -> float | None:
    return round(1000 * xs[int(0.99 * (len(xs) - 1))], 2) if xs else None


def _row(layout: str, n: int, k: int, run: dict[str, Any], events: list[dict]) -> dict[str, Any]:
    """A size's figures; the kill of group 0 judged from the lighthouse's own events: its first
    failure_detected of group 0 after the kill is the detection, any other verdict a false one."""
    results, latencies = run["results"], []
    rounds = len(results[0]["rounds"])
    for i in range(rounds):
        last_sent = max(r["rounds"][i][0] for r in results)  # one clock: CLOCK_MONOTONIC is system-wide
        latencies += [t - last_sent for r in results for t in r["rounds"][i][1]]
    ok = sorted(x for x in latencies if x == x)
    killed = next(r["killed_at"] for r in results if r["killed_at"] is not None)
    events = [e for e in events if e["t"] < run["ended"]]
    wrong = verdicts.false_failures(events, {0: [killed]}, within_s=DETECT_WAIT_S)
    seen = [e["t"] - killed for e in events if e["kind"] == "failure_detected" and e not in wrong]
    return {
        "layout": layout,
        "ranks": n,
        "group_size": k,
        "speakers": run["speakers"],
        "heartbeat_cpu_per_1000_ranks": round(run["idle_cpu"] / (n / 1000), 4),
        "rounds": rounds,
        "quorum_p50_ms": round(1000 * statistics.median(ok), 2) if ok else None,
        "quorum_p99_ms": _p99(ok),
        "heartbeat_p99_ms": _p99(sorted(x for r in results for x in r["beat_rtt"])),
        "generator_lag_max_ms": round(1000 * max(r["lag"] for r in results), 1),
        "failed_requests": len(latencies) - len(ok),
        "rounds_cpu_per_1000_ranks": round(run["rounds_cpu"] / (n / 1000), 4),
        # None: the lighthouse never failed the killed group within DETECT_WAIT_S
        "failure_detection_ms": round(1000 * min(seen), 1) if seen else None,
        "false_failures": len(wrong),
        "false_failure_reasons": sorted({str(e.get("reason")) for e in wrong}),
        "false_failure_s_before_kill": [round(killed - e["t"], 3) for e in wrong[:3]],
    }


def measure(root: Path, layout: str, n: int, k: int, a: argparse.Namespace, cores: tuple) -> dict[str, Any]:
    """One size on a fresh lighthouse of checkout `root` (its events in a scratch file)."""
    global LH_PID
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp, "events.jsonl")
        lh = _start_lighthouse(root, port, cores[0], log)
        LH_PID = lh.pid
        try:
            run = run_size(layout, n, k, port, a, cores[1])
        finally:
            lh.kill()
            lh.wait()
        events = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    return _row(layout, n, k, run, events)


LH_PID = 0


def _start_lighthouse(root: Path, port: int, cores: set[int] | None, events: Path) -> subprocess.Popen:
    # every simulated host shares 127.0.0.1 here: the per-address caps are a real host's times 1,000
    caps = ["--max-connections-per-peer", "65536", "--max-unauthenticated-per-peer", "65536"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    # an older commit's lighthouse (--compare) may lack the flags: its --help says
    argv = [sys.executable, "-m", "ftcore.lighthouse", "--help"]
    usage = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=60).stdout
    old = "--max-unauthenticated-per-peer" not in usage
    lh = subprocess.Popen(
        [sys.executable, "-m", "ftcore.lighthouse", "--bind", f"127.0.0.1:{port}", "--insecure"]
        + ["--events-file", str(events)]
        + ([] if old else caps),
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
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


def _hog_cores(on: str, cores: tuple) -> set[int] | None:
    return {"lighthouse": cores[0], "generators": cores[1]}.get(on)


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


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384, 100000])
    p.add_argument("--group-size", type=int, nargs="+", default=[8, 64], help="ranks per replica group")
    p.add_argument("--layout", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument(
        "--load", nargs="+", choices=hog.LOADS, default=list(hog.LOADS), help="each size quiet, beside a hog"
    )
    p.add_argument(
        "--hog-on",
        choices=("any", "lighthouse", "generators"),
        default="any",
        help="the hog's core: the scheduler's choice, the lighthouse's or the load generators'",
    )
    p.add_argument("--rounds", type=int, default=20, help="quorum rounds per size")
    p.add_argument("--procs", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1), help="load generators")
    p.add_argument(
        "--relay-max-groups",
        type=int,
        default=RELAY_MAX_GROUPS,
        help="the most real relays (groups) a size runs (their ranks are played beside them, on this machine)",
    )
    p.add_argument("--relay-max-ranks", type=int, default=RELAY_MAX_RANKS, help="... and the most ranks")
    p.add_argument(
        "--peer-root",
        type=Path,
        help="another checkout of ftrec (e.g. `git worktree add /tmp/old REV`): each rank-layout size runs "
        "against its lighthouse too, and the table gets the ratios",
    )
    p.add_argument("--json", default=str(ROOT / "bench-results" / "lighthouse_scale.json"))
    return p.parse_args()


def main() -> int:
    a = _args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still ends its lighthouse
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    cores = _pin()
    rows = []
    for layout, n, k in _runs(a):
        if layout == "relay" and (n // k > a.relay_max_groups or n > a.relay_max_ranks):
            print(
                f"not run: {n // k} real relays ({n} ranks in groups of {k}): "
                "above --relay-max-groups or --relay-max-ranks on this machine"
            )
            continue
        roots = [("this", ROOT)] + ([("peer", a.peer_root.resolve())] if a.peer_root and layout == "rank" else [])
        for load in a.load:  # interleaved: each size quiet, then beside a hog
            for name, root in roots:
                with hog.load(load, cores=_hog_cores(a.hog_on, cores)):
                    rows.append({"lighthouse": name, "load": load, **measure(root, layout, n, k, a, cores)})
                print(json.dumps(rows[-1]), flush=True)
    _print(rows, bool(a.peer_root))
    meta = {
        "heartbeat_interval_s": timeouts.HEARTBEAT_INTERVAL,
        "relay_interval_s": UPSTREAM_INTERVAL,
        "rank_to_relay_beat_s": RANK_BEAT_S,
        "procs": a.procs,
        "pinned": cores[0] is not None,
    }
    atomic_write_json(a.json, {**meta, "rows": rows}, indent=1)
    wrong = sum(r["false_failures"] for r in rows)
    print(f"\nfalse failures: {wrong}" + ("" if not wrong else " (a verdict against a group not killed, or before)"))
    return 1 if wrong else 0


def _print(rows: list[dict[str, Any]], peers: bool) -> None:
    cols = list(rows[0]) if rows else []
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    by = {(r["lighthouse"], r["load"], r["layout"], r["ranks"], r["group_size"]): r for r in rows}
    print(
        "\n| ranks | group size | layout | heartbeat p99 ms, quiet / hog | quorum p99 ms, quiet / hog | false fails |"
    )
    print("|---|---|---|---|---|---|")
    for (who, load, layout, n, k), r in by.items():
        hogged = by.get((who, "hog", layout, n, k), {}) if load == "quiet" else {}
        if who == "this" and (load == "quiet" or (who, "quiet", layout, n, k) not in by):
            wrong = r["false_failures"] + hogged.get("false_failures", 0)
            beats = f"{r['heartbeat_p99_ms']} / {hogged.get('heartbeat_p99_ms')}"
            print(
                f"| {n} | {k} | {layout} | {beats} | {r['quorum_p99_ms']} / {hogged.get('quorum_p99_ms')} | {wrong} |"
            )
    if peers:
        print("\n| ranks | load | quorum p99 this/peer (rank layout) |\n|---|---|---|")
        for (who, load, layout, n, k), r in by.items():
            peer = by.get(("peer", load, layout, n, k))
            if who == "this" and peer and r["quorum_p99_ms"] and peer["quorum_p99_ms"]:
                print(f"| {n} | {load} | {r['quorum_p99_ms'] / peer['quorum_p99_ms']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
