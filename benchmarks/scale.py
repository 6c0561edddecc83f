"""`python benchmarks/scale.py`: production size in one run, dataprep and training side by side.

Runs benchmarks/scale_dataprep.py (dataprep beside DuckDB and polars on one Parquet file, 1B
projected) at each `--events` size and benchmarks/scale_training.py (dense and row-wise item
optimizer steps, streamed full-ranking eval) at each `--items` size; prints one table, writes
bench-results/scale.json (`--json`). Small by default (2M events, 100K items: a few minutes,
`make bench`); `--large`: 10M and 100M events, 100K, 1M and 10M items (hours, ~10 GB of disk).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import scale_dataprep  # noqa: E402  (benchmarks/ is sys.path[0] when this runs as a script)

from ftcore.util.files import atomic_write_json  # noqa: E402

SMALL = {"events": "2M", "items": "100000"}
LARGE = {"events": "10M,100M", "items": "100000,1000000,10000000"}


def _dataprep(events: str, a: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"dataprep-{events}.json"
    argv = ["--events", events, "--memory-budget", a.memory_budget, "--json", str(out)]
    if a.dataprep_cases != "all":
        argv += ["--cases", a.dataprep_cases]
    scale_dataprep.main(argv + (["--data-dir", a.data_dir] if a.data_dir else []))
    return json.loads(out.read_text())


def _training(items: str, a: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / "training.json"
    argv = ["--items", items, "--steps", str(a.steps), "--eval-users", str(a.eval_users), "--json", str(out)]
    import scale_training  # torch: imported after the dataprep cases, whose children fork from here

    scale_training.main(argv)
    return json.loads(out.read_text())


def table(dataprep: list[dict], training: dict) -> list[str]:
    """The one table: a row per dataprep case and size, then per catalogue size and optimizer."""
    lines = [f"{'what':<46} {'size':>14} {'wall s':>8} {'rate':>14} {'peak RSS MB':>12} {'x duckdb':>9}"]
    for run in dataprep:
        for r in run["rows"]:
            if "error" in r:
                lines.append(f"{'dataprep: ' + r['case']:<46} {r['events']:>14,}  {r['error']}")
                continue
            rate = f"{r['events'] / r['wall_s'] / 1e6:.2f}M ev/s"
            vs = f"{r['wall_vs_duckdb']:.2f}" if "wall_vs_duckdb" in r else "-"
            lines.append(
                f"{'dataprep: ' + r['case']:<46} {r['events']:>14,} {r['wall_s']:>8.1f} {rate:>14} "
                f"{r['peak_rss_mb']:>12.0f} {vs:>9}"
            )
    res = training.get("results", {})
    for n, by_opt in res.get("train", {}).items():
        for opt, x in by_opt.items():
            rate, rss = f"{x['tokens_per_s']:.0f} tok/s", x["peak_rss_gb"] * 1024
            lines.append(f"{'training step: ' + opt:<46} {int(n):>14,} {'':>8} {rate:>14} {rss:>12.0f}")
    for n, e in res.get("eval", {}).items():
        rate = f"{e['users_per_s']:.0f} users/s"
        lines.append(
            f"{'full-ranking eval (streamed)':<46} {int(n):>14,} {'':>8} {rate:>14} {e['peak_rss_gb'] * 1024:>12.0f}"
        )
    lines.append("size: events (dataprep) or items (training); (projected) rows are estimates, not measurements")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/scale.py", description=__doc__.splitlines()[0])
    ap.add_argument("--large", action="store_true", help=f"the large sizes: {LARGE}")
    ap.add_argument("--events", help=f"dataprep sizes, comma-separated (default {SMALL['events']})")
    ap.add_argument("--items", help=f"catalogue sizes, comma-separated (default {SMALL['items']})")
    ap.add_argument("--memory-budget", default="512MB", help="the bucketed dataprep cases' --memory-budget")
    ap.add_argument("--dataprep-cases", default="all", help="scale_dataprep.py --cases (default all)")
    ap.add_argument("--data-dir", help="keep the event files here (scale_dataprep.py --data-dir)")
    ap.add_argument("--steps", type=int, default=10, help="timed training steps per size and optimizer")
    ap.add_argument("--eval-users", type=int, default=512, help="users ranked per catalogue size; 0: no evaluation")
    ap.add_argument("--skip", choices=("dataprep", "training"), help="leave one half out")
    ap.add_argument("--json", default=str(ROOT / "bench-results" / "scale.json"))
    a = ap.parse_args(argv)
    sizes = LARGE if a.large else SMALL
    events, items = a.events or sizes["events"], a.items or sizes["items"]
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        dataprep = [] if a.skip == "dataprep" else [_dataprep(e, a, Path(tmp)) for e in events.split(",")]
        training = {} if a.skip == "training" else _training(items, a, Path(tmp))
    print("\n" + "\n".join(table(dataprep, training)))
    atomic_write_json(a.json, {"argv": sys.argv, "dataprep": dataprep, "training": training}, indent=1)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
