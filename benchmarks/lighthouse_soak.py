"""One standing lighthouse serving thousands of short jobs: none refused, memory and fds flat.

    python benchmarks/lighthouse_soak.py [--jobs 5000] [--concurrent 50] [--json PATH]

A real lighthouse process (`python -m ftcore.lighthouse`, loopback, an admin secret, a live-job
cap far below the number of jobs) and, in this process, real ranks (ftcore.lighthouse_client,
each job's two groups with that job's own token): every job registers, heartbeats, forms a
quorum, and leaves; then `--concurrent` jobs run at once, a few rounds each. Sampled from
/proc every tenth of the run: the lighthouse's RSS and open file descriptors. Reported: jobs
run, quorums formed, refusals, jobs live at the end, RSS and fds after warm-up and at the end.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftcore import auth  # noqa: E402
from ftcore.lighthouse_client import LighthouseClient, LighthouseError, call  # noqa: E402
from ftcore.messages import RankInfo  # noqa: E402
from ftcore.util.files import atomic_write_json  # noqa: E402
from ftcore.util.procs import free_port  # noqa: E402

SECRET = "soak-bench-secret"


def _proc(pid: int) -> tuple[float, int]:
    """(RSS in MB, open fds) of a process."""
    rss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
    return rss / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def run_job(addr: str, job: str, rounds: int, tally: dict, lock: threading.Lock) -> None:
    """One job of two single-rank groups: heartbeats, `rounds` quorums, goodbye."""
    token = auth.job_token(SECRET, job)
    cs = [LighthouseClient(addr, RankInfo(group=g, rank=0, job=job, num_groups=2), token) for g in range(2)]
    for c in cs:
        c.start_heartbeats()
    out: list[object] = [None, None]
    try:
        for step in range(rounds):

            def ask(i: int, step: int = step) -> None:
                try:
                    cs[i].update(step=step)
                    out[i] = cs[i].quorum(timeout=10)
                except LighthouseError as e:
                    out[i] = e

            ts = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            ok = all(not isinstance(o, Exception) and o is not None for o in out)
            with lock:
                tally["quorums" if ok else "refused"] += 1
                if not ok:
                    tally.setdefault("errors", []).append(str(next(o for o in out if isinstance(o, Exception)))[:200])
    finally:
        for c in cs:
            c.leave()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=5000, help="short jobs one after another")
    p.add_argument("--concurrent", type=int, default=50, help="then this many jobs at once")
    p.add_argument("--max-jobs", type=int, default=64, help="the lighthouse's live-job cap (far below --jobs)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds before the whole run gives up")
    p.add_argument("--json", default=str(ROOT / "bench-results" / "lighthouse_soak.json"))
    a = p.parse_args()
    port = free_port()
    addr = f"127.0.0.1:{port}"
    lh = subprocess.Popen(
        [sys.executable, "-m", "ftcore.lighthouse", "--bind", addr, "--max-jobs", str(a.max_jobs)],
        cwd=ROOT,
        stdout=open(os.environ.get("SOAK_LOG", os.devnull), "w"),
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "FTCORE_TOKEN": SECRET},
    )
    tally: dict = {"quorums": 0, "refused": 0}
    lock = threading.Lock()
    samples: list[dict] = []
    t_start = time.monotonic()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if call(addr, "/jobs", None, SECRET, method="GET", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or lh.poll() is not None:
                raise SystemExit("the lighthouse did not start")
            time.sleep(0.1)
        for i in range(a.jobs):
            if time.monotonic() - t_start > a.timeout:
                raise SystemExit(f"gave up after {a.timeout:.0f}s at job {i}")
            run_job(addr, f"soak/{i}", 1, tally, lock)
            if i % max(a.jobs // 10, 1) == 0 or i == a.jobs - 1:
                rss, fds = _proc(lh.pid)
                samples.append({"jobs": i + 1, "rss_mb": round(rss, 1), "fds": fds})
                print(json.dumps(samples[-1]), flush=True)
        t_seq = time.monotonic() - t_start
        threads = [
            threading.Thread(target=run_job, args=(addr, f"soak/at-once/{i}", 5, tally, lock))
            for i in range(a.concurrent)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(a.timeout - (time.monotonic() - t_start), 1.0))
        time.sleep(1.0)  # the last jobs' retirement (a failure probe after their goodbye)
        rss, fds = _proc(lh.pid)
        samples.append({"jobs": a.jobs + a.concurrent, "rss_mb": round(rss, 1), "fds": fds})
        report = call(addr, "/jobs", None, SECRET, method="GET", timeout=5)[1]
    finally:
        lh.kill()
        lh.wait()
    warm = samples[min(1, len(samples) - 1)]
    row = {
        "jobs": a.jobs + a.concurrent,
        "max_live_jobs": a.max_jobs,
        "quorums_formed": tally["quorums"],
        "refused": tally["refused"],
        "live_at_end": len(report["live"]),
        "sequential_jobs_per_s": round(a.jobs / t_seq, 1),
        "rss_warm_mb": warm["rss_mb"],
        "rss_end_mb": samples[-1]["rss_mb"],
        "fds_warm": warm["fds"],
        "fds_end": samples[-1]["fds"],
    }
    cols = list(row)
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    atomic_write_json(a.json, {"row": row, "samples": samples, "errors": tally.get("errors", [])[:20]})
    return 0 if tally["refused"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
