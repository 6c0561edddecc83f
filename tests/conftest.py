"""Fixtures shared by every area's tests."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ftcore.util import procs as ports

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
if str(ROOT) not in sys.path:  # tests reuse the benchmarks' code (`from benchmarks.x import ...`)
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def shared_data() -> Path:
    """The real datasets beside the project; tests skip when a fresh clone lacks them."""
    if not (SHARED_DATA / "beauty.txt").exists():
        pytest.skip(f"shared datasets not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def free_port() -> int:
    return ports.free_port()


@pytest.fixture(autouse=True, scope="session")
def _checkpoint_key(tmp_path_factory):
    """One checkpoint key (FTREC_CHECKPOINT_KEY_FILE) for every test and every process a test
    starts, as a deployment's processes share one."""
    from training.checkpoint_key import KEY_ENV, KEY_NAME, ensure_key_file

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, str(ensure_key_file(tmp_path_factory.mktemp("key") / KEY_NAME)))
        yield


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    # Two cores are shared by every test process; keep torch from oversubscribing them.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


def torchrun_train(shards: str, out: str, port: int, settings: list[str], nproc: int = 2, timeout: float = 240) -> str:
    """`python -m training train` under torchrun on 127.0.0.1; returns its output.
    Bounded: on timeout the whole torchrun tree is ended by its process group."""
    import subprocess
    import sys

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [
        torchrun,
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "-m",
        "training",
        "train",
        "--shards",
        shards,
        "--out",
        out,
        "--set",
        *settings,
    ]
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        text, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    assert p.returncode == 0, text[-3000:]
    return text


def run_python(args: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python *args` from the project root in a process group of its own, bounded: on timeout
    the whole group is SIGKILLed and the test fails with the tail of the output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return run_bounded([sys.executable, *args], timeout, env)


def run_bounded(argv: list[str], timeout: float, env: dict, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`argv` with exactly `env`, in a process group of its own: on timeout the whole group is
    SIGKILLed and the test fails with the tail of the output."""
    p = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{argv[:3]} did not finish in {timeout}s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(argv, p.returncode, out)


TOY = "ftcore.examples.toy"
LAUNCH = ["-m", "training", "launch"]  # the interpreter's arguments that start the launcher


def launch_args(
    out: "str | os.PathLike",
    *,
    shards: "str | os.PathLike | None" = None,
    worker: str | None = None,
    groups: int = 2,
    ranks: int = 1,
    faults: "list[dict] | str | os.PathLike | None" = None,
    timeout: float | None = None,
    flags: list[str] | None = None,
    worker_args: list[str] | None = None,
) -> list[str]:
    """The interpreter's arguments for `python -m training launch`: the one place the tests
    spell the launcher's command line. `faults` is a plan file or the plan's faults (written
    beside OUT as OUT-plan.json); `worker_args` go after `--` to every rank."""
    out = Path(out)
    args = [*LAUNCH, "--replica-groups", str(groups), "--ranks-per-group", str(ranks)]
    args += ["--out", str(out), *(["--worker", worker] if worker else [])]
    args += ["--shards", str(shards)] if shards is not None else []
    if isinstance(faults, list):
        plan = out.parent / f"{out.name}-plan.json"
        plan.write_text(json.dumps({"faults": faults}))
        faults = plan
    args += ["--faults", str(faults)] if faults is not None else []
    args += ["--timeout", str(timeout)] if timeout is not None else []
    return [*args, *(flags or []), *(["--", *worker_args] if worker_args else [])]


def run_launch(out: "str | os.PathLike", limit: float, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """`python -m training launch` (launch_args' keywords) as a bounded child (run_python):
    ended by its process group after `limit` seconds."""
    return run_python(launch_args(out, **kw), limit, env)


def helped_pieces(ledger_dir: "str | os.PathLike") -> list[list[int]]:
    """The make-up pieces in a job's ledger that a group trained for another, (helper, owner,
    epoch, row group) each: the spread of a missed group's batches over the live ones."""
    from ftcore import ledger

    return [pc for rec, _ in ledger.read(str(ledger_dir)) for pc in rec.get("pieces") or [] if pc[0] != pc[1]]


def shard_sample_ids(shards: Path):
    """`sample_ids(shard, row_group)` for ftcore.ledger.check, read from a shard set's files."""
    import pyarrow.parquet as pq

    from dataprep import schema

    ids: dict[tuple[int, int], list[int]] = {}

    def sample_ids(shard: int, row_group: int) -> list[int]:
        if (shard, row_group) not in ids:
            pf = pq.ParquetFile(Path(shards) / schema.shard_file(shard))
            ids[shard, row_group] = pf.read_row_group(row_group, columns=["sample_id"]).column(0).to_pylist()
        return ids[shard, row_group]

    return sample_ids


def synthetic_shards(
    folder: "str | os.PathLike",
    *,
    users: int,
    items: int,
    seed: int,
    world_size: int,
    batch_size: int,
    max_len: int,
    median_len: float = 8,
    max_history: int = 40,
) -> Path:
    """A synthetic `sasrec` log, folder/ev.txt (dataprep's write_synthetic), built into a
    shard set, folder/shards (build_shards, in process); returns the shard set's folder."""
    from dataprep.build import build_shards
    from dataprep.synth import write_synthetic

    events, shards = Path(folder) / "ev.txt", Path(folder) / "shards"
    write_synthetic(str(events), users=users, items=items, seed=seed, median_len=median_len, max_history=max_history)
    build_shards(str(events), "sasrec", str(shards), world_size=world_size, batch_size=batch_size, max_len=max_len)
    return shards


def cli_shard_set(folder: Path, world_size: int = 2, users: int = 600) -> Path:
    """A small synthetic shard set (600 users, 200 items, 32 samples per rank and step),
    built through the command line as a user would: folder/shards."""
    events, shards = Path(folder) / "events.txt", Path(folder) / "shards"
    r = run_python(
        ["-m", "dataprep", "synth", "--out", str(events), "--users", str(users), "--items", "200", "--quiet"], 120
    )
    assert r.returncode == 0, r.stdout[-2000:]
    r = run_python(
        [
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
            str(world_size),
            "--batch-size",
            "32",
            "--max-len",
            "20",
            "--quiet",
        ],
        180,
    )
    assert r.returncode == 0, r.stdout[-2000:]
    return shards


@pytest.fixture
def lighthouse():
    """`start(**LighthouseConfig fields)` -> ("127.0.0.1:port", Lighthouse): real servers on
    loopback, closed after the test."""
    from ftcore.lighthouse import LighthouseConfig, serve

    servers = []

    def start(**kw):
        server, lh = serve(LighthouseConfig(bind="127.0.0.1:0", **kw))
        servers.append((server, lh))
        return f"127.0.0.1:{server.server_address[1]:d}", lh

    yield start
    for server, lh in servers:
        lh.close()
        server.shutdown()


def ask_all(clients, timeout: float = 5.0) -> list:
    """Every client's quorum() at once, as the ranks of a round ask; an exception is returned
    in its client's place."""
    import threading

    out: list = [None] * len(clients)

    def ask(i):
        try:
            out[i] = clients[i].quorum(timeout)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[i] = e

    ts = [threading.Thread(target=ask, args=(i,)) for i in range(len(clients))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


class IdleFlood:
    """`n` idle sockets to `addr` that never send a byte, kept topped up (at most `rate` new ones
    a second, the pace of the review's probes) from a thread until closed; every one is closed."""

    def __init__(self, addr: str, n: int = 200, rate: float = 50.0):
        import socket
        import threading

        self._socket = socket
        self.host, port = addr.rsplit(":", 1)
        self.port, self.n, self.rate = int(port), n, rate
        self.opened = 0
        self.socks: list = []
        self.stop = threading.Event()
        for _ in range(n):
            self._open()
        self.thread = threading.Thread(target=self._top_up, daemon=True)
        self.thread.start()

    def _open(self) -> None:
        try:
            s = self._socket.create_connection((self.host, self.port), timeout=2)
        except OSError:
            return
        s.setblocking(False)
        self.socks.append(s)
        self.opened += 1

    def _top_up(self) -> None:
        import select

        while not self.stop.wait(1 / self.rate):
            ready, _, _ = select.select(self.socks, [], [], 0) if self.socks else ([], [], [])
            for s in ready[:1]:  # closed (or refused with a 503) by the server: open another
                self.socks.remove(s)
                s.close()
            if len(self.socks) < self.n:
                self._open()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        for s in self.socks:
            s.close()

    def __enter__(self) -> "IdleFlood":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
