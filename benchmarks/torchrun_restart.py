"""What a restart costs: torchrun's own restart of a crashed group vs the launcher's warm spare.

    python benchmarks/torchrun_restart.py [--kills 4] [--json PATH]

The toy trainer (ftcore/examples/toy.py), 3 replica groups, step ~40 ms, heartbeat timeout
5 s (so nothing waits for it), one lighthouse on loopback. In one run, one after another:

- torchrun: each group one `torchrun --max-restarts` job, as on a cluster; kill -9 of a
  group's worker process, which its torchrun agent restarts cold (a new Python process:
  imports, process group, registration as a new incarnation, heal from a peer);
- launcher, warm spare (`python -m training launch`): the group continues in a process that
  had already imported everything;
- launcher, cold (`--no-spares`): a new process, as torchrun's, started by the launcher.

For each: kill -> the survivors' next commit, kill -> the returning group's first commit
(the heal time), and the survivors' extra stall, as benchmarks/ftcore_bench.py computes them.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ftcore_bench import bench_failover, failover_figures  # noqa: E402
from ftcore.util.procs import free_port  # noqa: E402

GROUPS, STEP_SLEEP, DIM = 3, 0.03, 64
ENV = {"FTCORE_HEARTBEAT_TIMEOUT": "5.0", "FTCORE_COLLECTIVE_TIMEOUT": "10", "FTCORE_QUORUM_TIMEOUT": "20"}


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _records(out: Path) -> list[dict]:
    recs = []
    for f in (out / "records").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return recs


def bench_torchrun(kills: int, timeout: float = 600) -> dict:
    steps = 40 + 250 * kills
    with tempfile.TemporaryDirectory() as d:
        out, token = Path(d) / "run", Path(d) / "token"
        out.mkdir()
        token.write_text("bench-token")
        token.chmod(0o600)
        port = free_port()
        env = {
            **os.environ,
            **ENV,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "FTCORE_LIGHTHOUSE": f"127.0.0.1:{port}",
            "FTCORE_TOKEN_FILE": str(token),
            "FTREC_NUM_REPLICA_GROUPS": str(GROUPS),
            "FTCORE_JOB_ID": "torchrun-bench",
        }
        env.pop("FTCORE_INCARNATION", None)
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "ftcore.lighthouse", "--bind", f"127.0.0.1:{port}", "--token-file", str(token)],
                env=env,
                cwd=ROOT,
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        ]
        torchrun = str(Path(sys.executable).parent / "torchrun")
        agents = {}
        try:
            for g in range(GROUPS):
                agents[g] = subprocess.Popen(
                    [
                        torchrun,
                        "--nnodes",
                        "1",
                        "--nproc-per-node",
                        "1",
                        "--rdzv-backend",
                        "c10d",
                        "--rdzv-endpoint",
                        f"127.0.0.1:{free_port()}",
                        "--rdzv-id",
                        f"bench-g{g}",
                        "--max-restarts",
                        str(kills + 2),
                        "--monitor-interval",
                        "0.1",
                        "-m",
                        "ftcore.examples.toy",
                        "--out",
                        str(out),
                        "--steps",
                        str(steps),
                        "--step-sleep",
                        str(STEP_SLEEP),
                        "--dim",
                        str(DIM),
                    ],
                    env={**env, "FTREC_REPLICA_GROUP": str(g)},
                    cwd=ROOT,
                    start_new_session=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                procs.append(agents[g])
            events, deadline = [], time.monotonic() + timeout
            for k in range(kills):
                g, at = k % GROUPS, 40 + 250 * k
                while max((r["step"] for r in _records(out) if r["group"] == g and r["committed"]), default=0) < at:
                    if time.monotonic() > deadline or agents[g].poll() is not None:
                        raise RuntimeError(f"group {g} did not reach step {at}")
                    time.sleep(0.02)
                workers = _children(agents[g].pid)
                t = time.time()
                for pid in workers:
                    os.kill(pid, signal.SIGKILL)
                events.append({"kind": "fault", "fault": "kill", "group": g, "t": t, "pids": workers})
            codes = [p.wait(timeout=max(1, deadline - time.monotonic())) for p in agents.values()]
            if any(codes):
                raise RuntimeError(f"torchrun exit codes {codes}")
            fig = failover_figures({"launcher_events": events, "steps": _records(out)})
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    return fig


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=4)
    p.add_argument("--json", default=str(ROOT / "bench-results" / "torchrun_restart.json"))
    a = p.parse_args()
    rows = {
        "torchrun restart (cold)": bench_torchrun(a.kills),
        "launcher, warm spare": bench_failover(a.kills, 0, spares=True),
        "launcher, cold": bench_failover(a.kills, 0, spares=False),
    }
    print(
        "\n| restart | step | kill -> survivors' next commit | kill -> returning group's first commit | "
        "survivors' extra stall |\n|---|---|---|---|---|"
    )

    def cell(f: dict, k: str) -> str:
        xs = f[k]
        return f"{_med(xs):.3f} s ({min(xs):.3f}-{max(xs):.3f})" if xs else "-"

    for name, f in rows.items():
        print(
            f"| {name} | {f['step_s'] * 1e3:.0f} ms | {cell(f, 'failover_samples_s')} | "
            f"{cell(f, 'heal_samples_s')} | {cell(f, 'stall_samples_s')} |"
        )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
