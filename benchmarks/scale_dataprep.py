"""`python benchmarks/scale_dataprep.py`: dataprep at scale beside DuckDB and polars, same file.

One synthetic event file (`python -m dataprep synth`; Parquet, or CSV by `--input-format csv`):
  dataprep in memory        the in-memory build (--memory-budget 64GB: the input fits)
  dataprep bucketed         the same shard set in buckets of users, --memory-budget (default 512MB)
  dataprep bucketed, 2 wk   the same with --workers 2
  duckdb / duckdb 1GB       group by user, items and times ordered by time, written to Parquet
                            (the second with memory_limit 1GB: it spills)
  polars                    the same grouping and sort, written to Parquet
Each case runs in a child process: wall time, and peak RSS of the child and its own children
(getrusage), and the most disk it took beyond what was in use when it began (work folder and
output, polled); dataprep's cases run its command line (`python -m dataprep shards`) from there.
dataprep does more than the grouping (leave-one-out samples, costs, balance plan, rejects, id
maps, checksums); the others only group and sort. `--events` sets the size
(default 2M, about a minute in all; 10M, 100M, 1B by flag: 1B needs ~9 GB for its file and
~30 GB more while it runs); below 1B a projection to 1B from the bucketed run's measured rate
and peak is printed as such. `--repeat N` runs every case N times, in turn: the table gives
medians, and ratios as the median of each round's own. Writes bench-results/scale_dataprep.json
(`--json`).
"""

import argparse
import json
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftcore.util.files import atomic_write_json  # noqa: E402
from ftcore.util.procs import exec_with_parent_death_signal  # noqa: E402

SHARD_ARGS: dict[str, Any] = {"world_size": 8, "batch_size": 256, "max_len": 200}
PROJECT_EVENTS = 1_000_000_000


def _count(text: str) -> int:
    """'2M', '10M', '1B', '500K' or a number -> events."""
    mult = {"K": 10**3, "M": 10**6, "B": 10**9}
    t = text.strip().upper()
    return int(float(t[:-1]) * mult[t[-1]]) if t[-1] in mult else int(t)


def _case(name: str, data: str, out: str, budget: str) -> None:
    """One measured case, in this (child) process."""
    csv = data.endswith(".csv")
    if name.startswith("dataprep"):
        # the command line users run (its own process: dataprep.process), from its interpreter's start
        args = [f"--{k.replace('_', '-')}={v}" for k, v in SHARD_ARGS.items()]
        args += ["--memory-budget", "64GB" if name == "dataprep in memory" else budget]
        args += ["--workers", "2"] if name.endswith("2 workers") else []
        cmd = [sys.executable, "-m", "dataprep", "shards", "--input", data, "--format", "events", "--out", out]
        subprocess.run([*cmd, *args, "--quiet"], check=True, cwd=ROOT, preexec_fn=exec_with_parent_death_signal)
    elif name.startswith("duckdb"):
        import duckdb

        con = duckdb.connect()
        if name == "duckdb 1GB":
            con.execute(f"SET memory_limit='1GB'; SET temp_directory='{out}.tmp'")
        src = f"read_csv('{data}')" if csv else f"read_parquet('{data}')"
        con.execute(
            f"COPY (SELECT user_id, list(item_id ORDER BY timestamp) AS items, "
            f"list(timestamp ORDER BY timestamp) AS times FROM {src} GROUP BY user_id) "
            f"TO '{out}.parquet' (FORMAT parquet)"
        )
    elif name == "polars":
        import polars as pl

        (
            (pl.scan_csv(data) if csv else pl.scan_parquet(data))
            .sort(["user_id", "timestamp"])
            .group_by("user_id", maintain_order=True)
            .agg(pl.col("item_id"), pl.col("timestamp"))
            .collect()
            .write_parquet(f"{out}.parquet")
        )


def _child(argv: list[str]) -> int:
    name, data, out, budget = argv
    t = time.perf_counter()
    _case(name, data, out, budget)
    wall = time.perf_counter() - t
    # this process's own peak (VmHWM: ru_maxrss would keep the forking parent's RSS across exec),
    # and its workers' (getrusage; those may still count what they forked from)
    hwm = int(next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM")).split()[1])
    rss = max(hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    print(json.dumps({"wall_s": wall, "peak_rss_mb": rss / 1024}))
    return 0


def _measure(name: str, data: Path, work: Path, budget: str, timeout: float) -> dict:
    out = work / name.replace(" ", "_").replace(",", "")
    cmd = [sys.executable, __file__, "--child", name, str(data), str(out), budget]
    used0, peak = shutil.disk_usage(work).used, 0
    try:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) as p:
            with ThreadPoolExecutor(1) as ex:
                reader = ex.submit(p.communicate)  # its pipes drained while the disk is polled
                deadline = time.monotonic() + timeout
                while p.poll() is None and time.monotonic() < deadline:
                    peak = max(peak, shutil.disk_usage(work).used - used0)
                    time.sleep(0.2)
                if p.poll() is None:
                    p.kill()  # by its own PID
                    reader.result()
                    return {"case": name, "error": f"over {timeout:.0f} s"}
                stdout, stderr = reader.result()
    finally:
        for x in work.glob(out.name + "*"):
            shutil.rmtree(x, ignore_errors=True) if x.is_dir() else x.unlink()
    if p.returncode:
        return {"case": name, "error": (stderr.strip().splitlines() or ["failed"])[-1]}
    return {"case": name, **json.loads(stdout.strip().splitlines()[-1]), "peak_disk_mb": peak / 2**20}


def _projection(row: dict, events: int, users: int) -> dict:
    """1B events from a bucketed run: time linear in events (buckets are independent and the same
    size under one budget); peak RSS = measured peak + per-user state growing with users (the
    plan stage's costs, lengths and plan, about 30 bytes a user: 1B events measured 1.6 GB)."""
    scale = PROJECT_EVENTS / events
    return {
        "case": f"{row['case']} (projected)",
        "events": PROJECT_EVENTS,
        "wall_s": row["wall_s"] * scale,
        "peak_rss_mb": row["peak_rss_mb"] + (users * scale - users) * 30 / 2**20,
        "projected": True,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    ap = argparse.ArgumentParser(prog="python benchmarks/scale_dataprep.py", description=__doc__.splitlines()[0])
    ap.add_argument("--events", default="2M", help="events in the file: 2M (default), 10M, 100M")
    ap.add_argument("--memory-budget", default="512MB", help="the bucketed cases' --memory-budget")
    ap.add_argument("--input-format", choices=("parquet", "csv"), default="parquet", help="the event file's format")
    ap.add_argument("--cases", default="all", help="comma-separated case names (default all)")
    ap.add_argument("--data-dir", help="where the event file is made (kept; default a temporary folder)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every case, interleaved (medians reported)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds a case may take")
    ap.add_argument("--json", default=str(ROOT / "bench-results" / "scale_dataprep.json"))
    a = ap.parse_args(argv)
    events = _count(a.events)
    tmp = Path(tempfile.mkdtemp(prefix="scale_dataprep-"))
    try:
        rows, users = _run(a, events, Path(a.data_dir) if a.data_dir else tmp, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _print(rows)
    atomic_write_json(
        a.json,
        {
            "events": events,
            "users": users,
            "input_format": a.input_format,
            "memory_budget": a.memory_budget,
            "machine": platform.machine(),
            "rows": rows,
        },
        indent=2,
    )
    print(f"wrote {a.json}")
    return 0


def _run(a: argparse.Namespace, events: int, data_dir: Path, work: Path) -> tuple[list[dict], int]:
    import pyarrow.parquet as pq

    data = data_dir / f"events-{a.events}.parquet"
    if not data.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        gen = [sys.executable, "-m", "dataprep", "synth", "--out", str(data), "--events", str(events)]
        subprocess.run([*gen, "--items", "100000", "--format", "events", "--quiet"], check=True, cwd=ROOT)
    n = pq.ParquetFile(data).metadata.num_rows
    users = _users(data)
    if a.input_format == "csv":  # the same events as CSV text (user_id,item_id,timestamp)
        csv = data.with_suffix(".csv")
        if not csv.exists():
            import pyarrow.csv as pcsv

            pcsv.write_csv(pq.read_table(data), str(csv) + ".tmp")
            Path(str(csv) + ".tmp").rename(csv)
        data = csv
    names = [
        "dataprep in memory",
        "dataprep bucketed",
        "dataprep bucketed, 2 workers",
        "duckdb",
        "duckdb 1GB",
        "polars",
    ]
    if a.cases != "all":
        names = [x for x in names if x in a.cases.split(",")]
    rounds = []
    for i in range(a.repeat):  # the cases in turn, round after round: a load change hits them all
        runs = [{**_measure(name, data, work, a.memory_budget, a.timeout), "events": n} for name in names]
        rounds.append(_ratios(runs))
        print(f"  round {i + 1}: {rounds[-1]}", file=sys.stderr)
    rows = [_median(list(runs)) for runs in zip(*rounds, strict=True)]
    base = {r["case"]: r for r in rows if "wall_s" in r}
    if "dataprep bucketed" in base and events < PROJECT_EVENTS:  # the file holds about `events`
        rows.append(_projection(base["dataprep bucketed"], n, users))
    return rows, users


def _users(data: Path) -> int:
    """Distinct users of the file, a batch at a time as dataprep's scan counts them: a billion
    events' user column read whole would take 8 GB. (Imported here: a child measures its own.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dataprep.counts import Counts

    users = Counts()
    for b in pq.ParquetFile(data).iter_batches(batch_size=1 << 22, columns=["user_id"]):
        users.add(b.column(0))
    n = users.table().num_rows
    pa.default_memory_pool().release_unused()  # the reader's buffers: not held while the cases run
    return n


def _ratios(rows: list[dict]) -> list[dict]:
    """Each case's wall time and peak RSS over DuckDB's and polars' in the same round."""
    base = {r["case"]: r for r in rows if "wall_s" in r}
    for r in rows:
        for ref in ("duckdb", "polars"):
            if "wall_s" in r and ref in base:
                r[f"wall_vs_{ref}"] = r["wall_s"] / base[ref]["wall_s"]
                r[f"rss_vs_{ref}"] = r["peak_rss_mb"] / base[ref]["peak_rss_mb"]
    return rows


def _median(runs: list[dict]) -> dict:
    """One case's rounds: median wall time and peak RSS; against DuckDB and polars, the median of
    the ratios taken within each round (the load of a moment slows both sides of it)."""
    ok = [r for r in runs if "wall_s" in r]
    if len(ok) < len(runs):
        return next(r for r in runs if "wall_s" not in r)
    row = {**ok[0], "walls_s": [r["wall_s"] for r in ok]}
    for k in ("wall_s", "peak_rss_mb"):
        row[k] = statistics.median(r[k] for r in ok)
    for ref in ("duckdb", "polars"):
        if all(f"wall_vs_{ref}" in r for r in ok):
            vs = [r[f"wall_vs_{ref}"] for r in ok]
            row[f"wall_vs_{ref}"], row[f"walls_vs_{ref}"] = statistics.median(vs), vs
    return row


def _print(rows: list[dict]) -> None:
    print(
        f"{'case':<38} {'events':>13} {'wall s':>9} {'peak RSS MB':>12} {'peak disk MB':>13} "
        f"{'x duckdb':>9} {'x polars':>9}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<38} {r['events']:>13,} {'':>9} {'':>12}  {r['error']}")
            continue
        x = lambda k, f=".2f", r=r: format(r[k], f) if k in r else "-"  # noqa: E731
        print(
            f"{r['case']:<38} {r['events']:>13,} {r['wall_s']:>9.1f} {r['peak_rss_mb']:>12.0f} "
            f"{x('peak_disk_mb', '.0f'):>13} {x('wall_vs_duckdb'):>9} {x('wall_vs_polars'):>9}"
        )
    print("x duckdb / x polars: wall time over theirs; the (projected) row is an estimate, not a measurement")


if __name__ == "__main__":
    sys.exit(main())
