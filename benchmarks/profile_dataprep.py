"""Where a bucketed dataprep build spends its time, function by function (issue #22).

    python benchmarks/profile_dataprep.py --input EVENTS.parquet [--memory-budget 512MB] [--top 30]

Runs `python -m dataprep shards` (the arguments of benchmarks/scale_dataprep.py) under cProfile
with every stage task in the calling thread, so the profile sees all of them: the times are one
core's, the sum of what the build's threads share out. Prints the functions by cumulative time;
the output set goes to a temporary folder, removed after.
"""

import argparse
import concurrent.futures as cf
import cProfile
import pstats
import runpy
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dataprep.bucketed as bucketed  # noqa: E402
from benchmarks.scale_dataprep import SHARD_ARGS  # noqa: E402


class Inline(cf.Executor):
    """An executor that runs each task at submit, in the calling thread."""

    def __init__(self, *_: Any) -> None:
        pass

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> cf.Future:
        fut: cf.Future = cf.Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - the caller's result() raises it
            fut.set_exception(e)
        return fut


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", required=True, help="an event file (Parquet or CSV), as `dataprep synth` writes")
    ap.add_argument("--memory-budget", default="512MB")
    ap.add_argument("--top", type=int, default=30, help="functions to print")
    ap.add_argument("--sort", default="cumulative", help="pstats order: cumulative, tottime, ...")
    a = ap.parse_args()
    bucketed.ThreadPoolExecutor = Inline  # type: ignore[misc,assignment]  # one thread: cProfile sees every task
    with tempfile.TemporaryDirectory(prefix="ftrec-profile-") as tmp:
        args = [f"--{k.replace('_', '-')}={v}" for k, v in SHARD_ARGS.items()]
        sys.argv = ["dataprep", "shards", "--input", a.input, "--format", "events", "--out", f"{tmp}/set"]
        sys.argv += [*args, "--memory-budget", a.memory_budget, "--quiet"]
        prof = cProfile.Profile()
        prof.enable()
        try:
            runpy.run_module("dataprep", run_name="__main__")
        except SystemExit as e:
            if e.code:
                raise
        finally:
            prof.disable()
    pstats.Stats(prof).sort_stats(a.sort).print_stats(a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
