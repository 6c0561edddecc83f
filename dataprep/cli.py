"""`python -m dataprep {synth,shards,verify,calibrate,stage}`: the command line over the Python API.

User errors print one line `error: ...` on stderr and exit 1 (no traceback).
"""

import argparse
import errno
import json
import sys
import time
from pathlib import Path

from dataprep.errors import DataprepError


def _synth(a) -> None:
    from dataprep.synth import write_synthetic

    users = a.users
    if users is None:
        if a.events is None:
            raise DataprepError("synth: give --users or --events")
        import numpy as np

        from dataprep.synth import SynthConfig, lengths

        mean = lengths(
            SynthConfig(1, 2, a.seed, a.median_len, a.sigma, a.min_len, a.max_history, a.zipf),
            np.random.default_rng(a.seed),
            200_000,
        ).mean()
        users = max(1, int(round(a.events / mean)))
    p = write_synthetic(
        a.out,
        users=users,
        items=a.items,
        seed=a.seed,
        fmt=a.format,
        median_len=a.median_len,
        sigma=a.sigma,
        min_len=a.min_len,
        max_history=a.max_history,
        zipf=a.zipf,
        quiet=a.quiet,
    )
    if not a.quiet:
        print(f"wrote {p} ({users} users, format {a.format})")


def _shards(a) -> None:
    from dataprep.build import build_shards
    from dataprep.settings import ShardSettings

    reader = {k: v for k, v in (("user_col", a.user_col), ("item_col", a.item_col), ("time_col", a.time_col)) if v}
    settings = ShardSettings(
        world_size=a.world_size,
        batch_size=a.batch_size,
        seed=a.seed,
        max_len=a.max_len,
        cost_model=a.cost_model,
        window_steps=a.window_steps,
        tail=a.tail,
        method=a.method,
        dedup=a.dedup,
        max_events=a.max_events,
        max_reject_fraction=a.max_reject_fraction,
        split=a.split,
        cut=a.cut,
        horizon=a.horizon,
        reader_options=reader,
    )
    m = build_shards(
        a.input,
        a.format,
        a.out,
        settings,
        quiet=a.quiet,
        overwrite=a.overwrite,
        memory_budget=a.memory_budget,
        buckets=a.buckets,
        workers=a.workers,
    )
    if a.json:
        print(json.dumps(m, indent=2))
    elif not a.quiet:
        c = m["counts"]
        print(
            f"wrote {a.out}: {m['steps']} steps x {m['config']['world_size']} ranks, {c['samples_written']} samples "
            f"({c['samples_dropped_tail']} dropped with the tail), {m['num_users']} users, {m['num_items']} items; "
            f"bubble {m['bubble_fraction']:.2%} (random {m['bubble_fraction_random']:.2%}), "
            f"imbalance p50 {m['imbalance']['p50']:.4f}; rejects {m['rejects'] or 'none'}"
        )


def _verify(a) -> None:
    from dataprep.verify import verify_shards

    m = verify_shards(a.dir, checksums=not a.no_checksums)
    if not a.quiet:
        print(
            f"ok: {a.dir}: {m['config']['world_size']} ranks x {m['steps']} steps, "
            f"{m['counts']['samples_written']} samples exactly once, {len(m['files'])} files match their SHA-256"
        )


def _calibrate(a) -> None:
    from dataprep.cost import calibrate, save

    lengths = [int(x) for x in a.lengths.split(",")]
    m = calibrate(lengths, batch=a.batch, repeats=a.repeats, model=a.model, budget_s=a.budget, quiet=a.quiet)
    save(m, a.out)
    if not a.quiet:
        print(f"wrote {a.out}: c(L) = {m.a:.4g}*L^2 + {m.b:.4g}*L + {m.c0:.4g} us (r2 {m.fit['r2']})")


STAGES = ("scan", "split", "bucket", "route", "write")  # the bucketed build's mapped stages


def _stage(a) -> None:
    if not a.work:  # the shard set was already there (a re-run): nothing to do
        print("the shard set exists; nothing to do")
        return
    from dataprep import bucketed, workdir

    t = time.monotonic()
    out = getattr(bucketed, a.name)(a.work, a.index)
    workdir.took(Path(a.work), a.name, a.index, time.monotonic() - t)
    print(json.dumps(out))


def _stage_args(sub) -> None:
    s = sub.add_parser("stage", help="one stage of the bucketed build on its work folder (a fanned-out task's pod)")
    s.add_argument("name", choices=STAGES)
    s.add_argument("work", help="the build's work folder (empty: the set was reused, nothing to do)")
    s.add_argument("index", type=int, help="the input file, bucket or rank")
    s.set_defaults(fn=_stage)


def _synth_args(sub) -> None:
    from dataprep.synth import SYNTH_FORMATS

    s = sub.add_parser("synth", help="write a synthetic interaction log (Zipf items, lognormal lengths)")
    s.add_argument("--out", required=True, help="file to write")
    s.add_argument("--users", type=int, help="number of users")
    s.add_argument("--events", type=int, help="about this many events in total (instead of --users)")
    s.add_argument("--items", type=int, default=10_000, help="catalogue size (default 10000)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--format", choices=SYNTH_FORMATS, default="sasrec")
    s.add_argument("--median-len", type=float, default=20.0, help="median history length (default 20)")
    s.add_argument("--sigma", type=float, default=1.2, help="lognormal shape; larger = heavier tail (default 1.2)")
    s.add_argument("--min-len", type=int, default=5, help="shortest history (default 5)")
    s.add_argument("--max-history", type=int, default=4096, help="longest history (default 4096)")
    s.add_argument("--zipf", type=float, default=1.1, help="item popularity exponent (default 1.1)")
    s.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    s.set_defaults(fn=_synth)


def _shards_args(sub) -> None:
    from dataprep.balance import DEFAULT_WINDOW_STEPS
    from dataprep.readers import FORMATS
    from dataprep.rejects import MAX_REJECT_FRACTION
    from dataprep.settings import DEDUP, METHODS, TAILS

    s = sub.add_parser("shards", help="build a length-balanced shard set")
    s.add_argument("--input", required=True, nargs="+", help="input file(s); for events also a Parquet folder")
    s.add_argument("--format", required=True, choices=FORMATS)
    s.add_argument("--out", required=True, help="shard-set folder to create")
    s.add_argument("--world-size", type=int, required=True, help="data-parallel ranks W (replica groups x ranks)")
    s.add_argument("--batch-size", type=int, required=True, help="samples per rank per step, on average")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--max-len", type=int, default=50, help="longest input history kept, most recent (default 50)")
    s.add_argument("--cost-model", help="JSON from `calibrate` (default: built-in coefficients)")
    s.add_argument(
        "--window-steps",
        type=int,
        default=None,
        help=f"K: steps per cost-sorted window; 1 = fully random batches (default {DEFAULT_WINDOW_STEPS})",
    )
    s.add_argument(
        "--tail",
        choices=TAILS,
        default="fill",
        help="fill: spread the N mod W*B leftover samples over the steps; drop: drop them (default fill)",
    )
    s.add_argument("--method", choices=METHODS, default="auto", help="partitioner: lpt, kk or auto (best of both)")
    s.add_argument(
        "--dedup",
        choices=DEDUP,
        default="exact",
        help="exact: drop repeated (user, item, time) events; consecutive: also repeated items in a row",
    )
    s.add_argument("--max-events", type=int, default=None, help="reject users with more events than this (bots)")
    s.add_argument(
        "--max-reject-fraction",
        type=float,
        default=MAX_REJECT_FRACTION,
        help=f"fail when more input lines than this are rejected (default {MAX_REJECT_FRACTION})",
    )
    _split_args(s)
    s.add_argument("--user-col", help="events: user column (default user_id)")
    s.add_argument("--item-col", help="events: item column (default item_id)")
    s.add_argument("--time-col", help="events: timestamp column (default timestamp)")
    s.add_argument(
        "--memory-budget",
        help="memory the build may use, like 512MB or 4GB (default: a quarter of the machine); inputs "
        "that need more are built in buckets of users on disk, into the same files",
    )
    s.add_argument("--buckets", type=int, help="build in this many buckets of users, whatever the budget")
    s.add_argument(
        "--workers", type=int, default=1, help="processes building buckets and rank files at once (default 1)"
    )
    s.add_argument("--overwrite", action="store_true", help="replace a different shard set at --out")
    s.add_argument("--json", action="store_true", help="print the manifest")
    s.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    s.set_defaults(fn=_shards)


def _split_args(s) -> None:
    """How the set holds out what evaluation scores (dataprep/temporal.py)."""
    from dataprep.settings import SPLITS

    s.add_argument(
        "--split",
        choices=SPLITS,
        default="leave_one_out",
        help="leave_one_out: each user's last event tests, the one before validates; temporal: events at "
        "or before --cut train, each user's first event after it (within --horizon) tests (timed formats)",
    )
    s.add_argument("--cut", type=int, help="temporal: the cut time T, epoch seconds (default: 90%% of events before)")
    s.add_argument("--horizon", type=int, help="temporal: seconds after the cut a test event may be (default: all)")


def _verify_args(sub) -> None:
    s = sub.add_parser("verify", help="check a shard set (checksums, schema, exactly-once, equal steps)")
    s.add_argument("dir")
    s.add_argument("--no-checksums", action="store_true", help="skip SHA-256 (faster)")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=_verify)


def _calibrate_args(sub) -> None:
    s = sub.add_parser("calibrate", help="fit the cost model c(L) = a*L^2 + b*L + c0 from timings")
    s.add_argument("--out", required=True, help="JSON file to write")
    s.add_argument(
        "--model",
        choices=("standin",),
        default="standin",
        help="standin: a small causal-attention model (the training model: `ftrec calibrate`)",
    )
    s.add_argument("--lengths", default="8,16,32,64,128,256,512,1024", help="comma-separated lengths")
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--budget", type=float, default=120.0, help="stop timing after this many seconds")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=_calibrate)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dataprep", description="raw interactions -> length-balanced shards")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_synth_args, _shards_args, _verify_args, _calibrate_args, _stage_args):
        add(sub)
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    try:
        a.fn(a)
    except DataprepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; nothing was left half-written", file=sys.stderr)
        return 130
    except OSError as e:  # disk full, permissions: name the file
        where = f"{e.filename}: " if e.filename else ""
        hint = (
            "free some space or choose another --out"
            if e.errno == errno.ENOSPC
            else "check the path and its permissions"
        )
        print(f"error: {where}{e.strerror or e}; {hint}", file=sys.stderr)
        return 1
    return 0
