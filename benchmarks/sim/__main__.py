"""`python -m benchmarks.sim`: effective training time and bubbles at scale.

Prints a table, writes OUT/sim.json and OUT/sim-*.png (OUT defaults to bench-results).
"""

import argparse
import sys
import time
from pathlib import Path

from benchmarks.sim import report
from benchmarks.sim.balance import LengthsError
from benchmarks.sim.config import SimConfigError, load

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", help="TOML file (sections job, failures, restart, checkpoint, fthsdp, balance, sweep)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting, value in TOML syntax (repeatable), e.g. --set job.gpus=16384",
    )
    p.add_argument("--out", default="bench-results", help="folder for sim.json and the PNG plots")
    p.add_argument(
        "--bench-dir",
        default=str(ROOT / "bench-results"),
        help="where ftrec's benchmark JSON files are read for calibration",
    )
    p.add_argument("--no-sweeps", action="store_true", help="only the configured job and the paper check")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        cfg = load(args.config, args.set)
        rep = report.build(cfg, Path(args.bench_dir), ROOT.parent / "shared" / "data", sweeps=not args.no_sweeps)
    except (SimConfigError, LengthsError) as e:
        print(f"benchmarks.sim: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        files = [] if args.no_sweeps else report.plots(rep, out)
        rep["seconds"]["total"] = round(time.perf_counter() - t0, 3)
        report.write_json(rep, out / "sim.json")
    except OSError as e:
        print(f"benchmarks.sim: cannot write to {out}: {e}", file=sys.stderr)
        return 2
    try:
        print(report.table(rep))
        print(
            f"\nwrote {out / 'sim.json'}"
            + "".join(f"\nwrote {f}" for f in files)
            + f"\n({rep['seconds']['total']:.1f} s)",
            flush=True,
        )
    except BrokenPipeError:  # `| head`: the files are written, the reader left early
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
