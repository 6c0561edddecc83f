"""build_shards: raw interactions -> a verified-looking shard set, atomically.

The long form: docs/dataprep.md, "dataprep/build"."""

import glob
import json
import os
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dataprep import balance, bucketed, readers, schema, sequences, temporal
from dataprep.cost import CostModel, load_cost_model
from dataprep.errors import DataprepError, DifferentShardSet
from dataprep.files import sha256_file
from dataprep.fingerprint import fingerprint, fingerprint_later
from dataprep.progress import Progress, stage
from dataprep.rejects import check_rejects, reject_table, tail_rejects
from dataprep.settings import ShardSettings


def _refuse_input_inside(out: Path, inputs: list[str]) -> None:
    """A shard set replaces its folder whole: never one that holds (or is) the input."""
    root = out.resolve()
    for p in inputs:
        if not readers.is_uri(p) and Path(p).resolve().is_relative_to(root):
            raise DataprepError(
                f"--out {out} contains the input {p}: a shard set replaces its folder whole; "
                "write it to a folder of its own"
            )


def _shard_set_manifest(out: Path) -> dict | None:
    """The manifest of `out` if it is a shard set dataprep wrote: a manifest with the required
    keys whose `files` lists every other file in the folder (so replacing it deletes nothing else)."""
    try:
        m = json.loads((out / schema.MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    keys = ("format_version", "input", "config", "files", "num_items", "steps")
    if not isinstance(m, dict) or any(k not in m for k in keys) or not isinstance(m["files"], dict):
        return None
    found = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_symlink() or not p.is_dir()} - {
        schema.MANIFEST
    }
    return m if found <= set(m["files"]) and m["format_version"] in schema.READ_VERSIONS else None


def _existing(out: Path, fp: str, config: dict, version: int, overwrite: bool) -> dict | None:
    """The manifest of an identical set already at `out`, or None if `out` may be (re)written.

    `overwrite` replaces a shard set only (a folder with a manifest), never a folder of other files."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise DataprepError(f"{out}: exists and is not a folder; choose another --out")
    mpath = out / schema.MANIFEST
    if mpath.exists():
        m = _shard_set_manifest(out)
        if m is None:
            raise DataprepError(
                f"{out}: its {schema.MANIFEST} is not a dataprep shard-set manifest listing every file in the "
                "folder, so it is not replaced; choose another --out (or empty the folder yourself)"
            )
        same = (
            m.get("format_version") == version
            and m.get("input", {}).get("fingerprint") == fp
            and m.get("config") == config
            and all((out / f).exists() for f in m.get("files", {"-": 0}))
        )
        if same and not overwrite:
            return m
        if not overwrite:
            raise DifferentShardSet(
                f"{out}: holds a different shard set (other input or settings); "
                "pass --overwrite to replace it or choose another --out"
            )
        return None
    if any(out.iterdir()):
        raise DataprepError(
            f"{out}: folder is not empty and holds no shard set (no {schema.MANIFEST}); "
            "choose another --out (--overwrite replaces shard sets only, never other files)"
        )
    return None


def _write_parquet(path: Path, table: pa.Table, **options) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, **options)


def _write_shards(tmp: Path, samples: sequences.Samples, cost: np.ndarray, p: balance.Plan, quiet: bool) -> None:
    keep = np.flatnonzero(p.step >= 0)
    order = keep[np.lexsort((p.step[keep], p.rank[keep]))]
    idx = pa.array(order)
    table = pa.table(
        {
            "sample_id": pa.array(order.astype(np.int64)),
            "user_id": pa.array(samples.user_id[order]),
            "step": pa.array(p.step[order]),
            "rank": pa.array(p.rank[order]),
            "length": pa.array(samples.length[order]),
            "cost": pa.array(cost[order]),
            "items": pc.take(samples.items, idx),
            "target": pa.array(samples.target[order]),
            **({schema.TIMESTAMPS: pc.take(samples.timestamps, idx)} if samples.timestamps is not None else {}),
        },
        schema=schema.shard_schema(samples.timestamps is not None),
    )
    # row boundaries of every (rank, step) block: all blocks are non-empty by construction
    key = p.rank[order].astype(np.int64) * p.steps + p.step[order]
    bounds = np.searchsorted(key, np.arange(p.world_size * p.steps + 1))
    (tmp / schema.SHARDS_DIR).mkdir(parents=True)
    with Progress("write", p.world_size, quiet=quiet, unit=" ranks") as bar:
        for r in range(p.world_size):
            with pq.ParquetWriter(tmp / schema.shard_file(r), table.schema, **schema.write_options(table.schema)) as w:
                for s in range(p.steps):
                    a, b = bounds[r * p.steps + s], bounds[r * p.steps + s + 1]
                    w.write_table(table.slice(a, b - a))  # one call = one row group = one step
            bar.update()


def _checked_inputs(input: "str | list[str]", fmt: str) -> list[str]:
    """The input paths, each checked before anything reads it (a device would be read forever)."""
    paths = [str(p) for p in ([input] if isinstance(input, (str, os.PathLike)) else input)]
    for path in paths:
        readers.check_input(path)
    if fmt not in readers.FORMATS:
        raise DataprepError(f"--format {fmt!r}: unknown; choose one of {', '.join(readers.FORMATS)}")
    return paths


def _head(paths: list[str], fmt: str, fp: str, config: dict) -> dict:
    """The manifest's head: format version, input (absolute paths, format, fingerprint), config."""
    return {
        "format_version": schema.format_version(fmt in readers.TIME_FORMATS),
        "input": {
            "paths": [x if readers.is_uri(x) else str(Path(x).resolve()) for x in paths],
            "format": fmt,
            "fingerprint": fp,
        },
        "config": config,
    }


def _config(s: ShardSettings, cm: CostModel, fmt: str) -> dict:
    """The set's config: the settings that decide its bytes (the manifest's; a build whose
    config and input equal an existing set's reuses it), in the manifest's key order."""
    k = balance.DEFAULT_WINDOW_STEPS if s.window_steps is None else int(s.window_steps)
    return {
        "world_size": s.world_size,
        "batch_size": s.batch_size,
        "max_len": s.max_len,
        "seed": s.seed,
        "window_steps": k,
        # the device a calibrated model was timed on (training/calibrate.py): the training device
        "cost_model": {"a": cm.a, "b": cm.b, "c0": cm.c0, "source": cm.source}
        | ({"device": cm.fit["device"]} if cm.fit.get("device") else {}),
        "tail": s.tail,
        "method": s.method,
        "dedup": s.dedup,
        "max_events": s.max_events,
        "reader_options": dict(sorted(s.reader_options.items())),
        # the split's entries (none for leave-one-out); a temporal split needs a format with times
        **temporal.settings(s.split, s.cut, s.horizon, fmt, readers.TIME_FORMATS),
    }


def prepare(
    input: "str | list[str]",
    fmt: str,
    out: str,
    settings: ShardSettings,
    *,
    quiet: bool = True,
    overwrite: bool = False,
    defer_fingerprint: bool = False,
) -> "BuildJob":
    """Check the inputs and say what to build with `settings` (checked when it was made): the
    set's config and manifest head, and the manifest of an identical set already at `out`
    (None: build it). See build_shards. `overwrite`: replace a different shard set at `out`.
    `defer_fingerprint`: where `out` holds no manifest (nothing to reuse), the inputs' hash is
    taken in a thread beside the build; BuildJob.settle puts it into the head."""
    paths = _checked_inputs(input, fmt)
    config = _config(settings, load_cost_model(settings.cost_model), fmt)
    outp = Path(out)
    _refuse_input_inside(outp, paths)
    pending = fingerprint_later(paths) if defer_fingerprint and not (outp / schema.MANIFEST).exists() else None
    with stage("fingerprint", quiet=quiet or pending is not None):
        fp = fingerprint(paths) if pending is None else ""
    head = _head(paths, fmt, fp, config)
    return BuildJob(
        pending=pending,
        paths=paths,
        fmt=fmt,
        outp=outp,
        config=config,
        head=head,
        reader_options=dict(settings.reader_options),
        max_reject_fraction=settings.max_reject_fraction,
        existing=_existing(outp, fp, config, head["format_version"], overwrite),
    )


@dataclass
class BuildJob:
    """A shard set to build (see prepare)."""

    paths: list[str]
    fmt: str
    outp: Path
    config: dict
    head: dict
    reader_options: dict
    max_reject_fraction: float
    existing: dict | None
    pending: "Future[str] | None" = None  # the deferred fingerprint (prepare's defer_fingerprint)

    def settle(self) -> None:
        """The head's fingerprint, once a deferred one is taken (raises what hashing raised)."""
        if self.pending is not None:
            self.head["input"]["fingerprint"] = self.pending.result()
            self.pending = None

    def bucketed_context(self) -> dict:
        """What every stage of dataprep.bucketed reads (its work folder's ctx.json)."""
        return {
            "paths": self.paths,
            "spans": readers.spans(self.paths, self.fmt, **self.reader_options),
            "fmt": self.fmt,
            "config": self.config,
            "reader_options": self.reader_options,
            "has_time": self.fmt in readers.TIME_FORMATS,
            "max_reject_fraction": self.max_reject_fraction,
        }


def build_shards(
    input: "str | list[str]",
    fmt: str,
    out: str,
    settings: ShardSettings | None = None,
    *,
    quiet: bool = True,
    log: Callable[[str], None] | None = None,
    memory_budget: "str | int | None" = None,
    buckets: int | None = None,
    workers: int = 1,
    overwrite: bool = False,
    **kw,
) -> dict:
    """Build a shard set at `out` with `settings` and return its manifest (see dataprep.schema).

    Without `settings`, the keywords `kw` make the record (ShardSettings.from_kwargs:
    world_size=..., a reader's user_col=...). `overwrite`: replace a different set at `out`.
    `log` receives one line per stage as it ends (an Airflow task log shows the build's
    progress). Inputs that fit `memory_budget` (default: a quarter of the machine) are built in
    memory; larger ones, or any with `buckets` or `workers` > 1, by dataprep.bucketed, into the
    same bytes. Raises DataprepError for anything the user can fix.
    """
    budget = bucketed.parse_size(memory_budget) if memory_budget is not None else bucketed.default_budget()
    if buckets is not None and buckets < 1 or workers < 1:
        raise DataprepError("--buckets and --workers must be >= 1")
    settings = _settings(settings, kw)
    say = log or (lambda line: None)
    t_all = time.monotonic()
    job = prepare(input, fmt, out, settings, quiet=quiet, overwrite=overwrite, defer_fingerprint=True)
    if job.existing is not None:
        say(f"dataprep: {job.outp} already holds this shard set ({job.existing.get('steps')} steps); reused")
        return job.existing
    timings: dict[str, float] = {}
    if buckets is not None or workers > 1 or bucketed.estimate(job.paths, fmt) > budget:
        if log is None and not quiet:
            say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        return _build_bucketed(job, budget, buckets, workers, say=say, timings=timings, t_all=t_all)
    c = job.config
    ev, seq, ev_table, samples, split = _samples(
        job.paths, fmt, c, job.max_reject_fraction, job.reader_options, quiet=quiet, say=say, timings=timings
    )
    cost = load_cost_model(c["cost_model"])(samples.length)
    p, st, st_random = _balance(cost, c, quiet=quiet, say=say, timings=timings)
    built = _Built(ev, seq, ev_table, samples, cost, p, st, st_random, split)
    job.settle()
    return _write_set(job.outp, built, job.head, quiet=quiet, say=say, timings=timings, t_all=t_all)


def _settings(settings: ShardSettings | None, kw: dict) -> ShardSettings:
    """build_shards' record: `settings`, or one made of its keyword settings (never both)."""
    if settings is None:
        return ShardSettings.from_kwargs(**kw)
    if kw:
        raise TypeError(f"build_shards: give a ShardSettings or keyword settings, not both (also got {', '.join(kw)})")
    return settings


def _build_bucketed(
    job: BuildJob,
    budget: int,
    buckets: int | None,
    workers: int,
    *,
    say: Callable[[str], None],
    timings: dict[str, float],
    t_all: float,
) -> dict:
    """build_shards by dataprep.bucketed, in a temporary folder beside the set, then sealed."""
    tmp = new_staging(job.outp)
    try:
        rejects, fig, t_write, sums = bucketed.run(
            tmp, job.bucketed_context(), budget=budget, buckets=buckets, workers=workers, say=say, timings=timings
        )
        job.settle()
        return seal(
            tmp, job.outp, job.head, fig, rejects, timings=timings, t_write=t_write, t_all=t_all, say=say, sums=sums
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass
class _Built:
    """What a shard set is made of, stage by stage, before it is written."""

    ev: readers.Interactions
    seq: sequences.Sequences
    eval_table: pa.Table
    samples: sequences.Samples
    cost: np.ndarray
    plan: balance.Plan
    stats: dict
    stats_random: dict  # of random shards: what balancing gains
    split: dict  # the temporal split's figures (dataprep/temporal.py); empty: leave-one-out


def _samples(
    paths: list[str],
    fmt: str,
    config: dict,
    max_reject_fraction: float,
    reader_options: dict,
    *,
    quiet: bool,
    say: Callable[[str], None],
    timings: dict[str, float],
) -> tuple[readers.Interactions, sequences.Sequences, pa.Table, sequences.Samples, dict]:
    """read -> sequences -> leave-one-out samples, each stage timed and logged."""
    t = time.monotonic()
    with stage("read", quiet=quiet):
        ev = readers.read(paths, fmt, **reader_options)
    check_rejects(ev.rejects, ev.counts.get("lines", 0), max_reject_fraction)
    timings["read_s"] = time.monotonic() - t
    say(
        f"dataprep: read {ev.counts.get('lines', 0)} lines, {len(ev)} events, "
        f"{sum(r.num_rows for r in ev.rejects)} rejected ({timings['read_s']:.1f} s)"
    )
    t = time.monotonic()
    with stage("sequences", quiet=quiet):
        seq = sequences.build_sequences(ev, dedup=config["dedup"], max_events=config["max_events"])
        hold = temporal.holdout(seq, config)  # leave-one-out, or the temporal cut
        ev_table, samples = sequences.eval_table(seq, hold), sequences.train_samples(seq, config["max_len"], hold)
    timings["sequences_s"] = time.monotonic() - t
    n = len(samples.user_id)
    say(
        f"dataprep: {seq.num_users} users, {seq.num_items} items, {n} training samples ({timings['sequences_s']:.1f} s)"
    )
    if n == 0:
        raise DataprepError(
            f"{', '.join(paths)}: no user has the 4 events a training sample needs "
            "(history, target, validation, test); give more data"
        )
    return ev, seq, ev_table, samples, hold.info


def _balance(
    cost: np.ndarray, config: dict, *, quiet: bool, say: Callable[[str], None], timings: dict[str, float]
) -> tuple[balance.Plan, dict, dict]:
    """The balanced plan, its stats, and the stats of random shards (the manifest compares them)."""
    c = config
    t = time.monotonic()
    with stage("balance", quiet=quiet):
        # the random baseline first, so the two plans are never held at once
        st_random = balance.stats(
            balance.random_plan(
                cost, world_size=c["world_size"], batch_size=c["batch_size"], seed=c["seed"], tail=c["tail"]
            ),
            cost,
        )
        p = balance.plan(
            cost,
            world_size=c["world_size"],
            batch_size=c["batch_size"],
            window_steps=c["window_steps"],
            seed=c["seed"],
            tail=c["tail"],
            method=c["method"],
        )
        st = balance.stats(p, cost)
    timings["balance_s"] = time.monotonic() - t
    say(
        f"dataprep: {p.steps} steps balanced over {c['world_size']} ranks, bubble {st['bubble_fraction']:.4f} "
        f"(random shards: {st_random['bubble_fraction']:.4f}) ({timings['balance_s']:.1f} s)"
    )
    return p, st, st_random


def _write_set(
    outp: Path,
    built: _Built,
    head: dict,
    *,
    quiet: bool,
    say: Callable[[str], None],
    timings: dict[str, float],
    t_all: float,
) -> dict:
    """Write the set into a temporary folder beside `outp`, then rename it into place."""
    p = built.plan
    seq, samples = built.seq, built.samples
    rejects = list(seq.rejects)
    if p.dropped:
        d = np.flatnonzero(p.step < 0)
        rejects.append(tail_rejects(pc.take(seq.user_raw, pa.array(samples.user_id[d] - 1)), d))
    tmp = new_staging(outp)
    t = time.monotonic()
    try:
        _write_shards(tmp, built.samples, built.cost, p, quiet)
        _write_parquet(tmp / schema.EVAL_FILE, built.eval_table, **schema.write_options(built.eval_table.schema))
        _write_parquet(tmp / schema.USER_MAP, built.seq.user_map())
        _write_parquet(tmp / schema.ITEM_MAP, built.seq.item_map())
        return seal(tmp, outp, head, _figures(built), rejects, timings=timings, t_write=t, t_all=t_all, say=say)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def new_staging(outp: Path) -> Path:
    """A new, empty temporary folder beside `outp` (stale ones of dead builds removed first)."""
    outp.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(outp)
    tmp = outp.parent / f".{outp.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def seal(
    tmp: Path,
    outp: Path,
    head: dict,
    figures: dict,
    rejects: list[pa.Table],
    *,
    timings: dict[str, float],
    t_write: float,
    t_all: float,
    say: Callable[[str], None],
    sums: dict[str, str] | None = None,
) -> dict:
    """Finish a staged set (shards, eval and maps written): rejects, checksums, manifest, then
    rename it into place. Returns the manifest. `sums`: checksums of files already taken."""
    rej, by_reason = reject_table(rejects)
    _write_parquet(tmp / schema.REJECTS_FILE, rej)
    names = [str(f.relative_to(tmp)) for f in sorted(tmp.rglob("*")) if f.is_file()]
    files = {n: (sums or {}).get(n) or sha256_file(tmp / n) for n in names}
    timings["write_s"] = time.monotonic() - t_write
    timings["total_s"] = time.monotonic() - t_all
    manifest = _manifest(head, figures, by_reason, timings, files)
    (tmp / schema.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    _install(tmp, outp)
    say(f"dataprep: wrote {len(files)} files to {outp} ({timings['write_s']:.1f} s)")
    return manifest


def _figures(built: _Built) -> dict:
    """What the manifest says of a built set (see _manifest)."""
    ev, seq, samples, p, st, cost = built.ev, built.seq, built.samples, built.plan, built.stats, built.cost
    n = len(samples.user_id)
    return {
        "num_users": seq.num_users,
        "num_items": seq.num_items,
        "num_samples": n,
        "steps": p.steps,
        "counts": {
            "lines": ev.counts.get("lines", 0),
            "blank_lines": ev.counts.get("blank_lines", 0),
            "events_read": len(ev),
            "events_used": seq.counts["events_used"],
            "duplicates": seq.counts["duplicates"],
            "rows_rejected": sum(t_.num_rows for t_ in ev.rejects),
            "users_read": seq.counts["users_read"],
            "users_rejected": seq.counts["users_rejected"],
            "eval_users": built.eval_table.num_rows,
            "users_without_sample": seq.num_users - n,
            "samples_written": n - p.dropped,
            "samples_dropped_tail": p.dropped,
            "samples_filled_tail": p.filled,
            "samples_truncated": samples.truncated,
            "items_truncated": samples.items_truncated,
            "tokens": int(samples.length.sum()),
        },
        "stats": st,
        "bubble_fraction_random": built.stats_random["bubble_fraction"],
        "total_cost": float(cost[p.step >= 0].sum()),
        "time_unit": seq.time_unit,
        "split": built.split,
    }


def _manifest(
    head: dict, fig: dict, by_reason: dict[str, int], timings: dict[str, float], files: dict[str, str]
) -> dict:
    """The manifest.json of a written set (see dataprep.schema); `head`: format_version, input, config;
    `fig`: the set's figures (see _figures)."""
    st = fig["stats"]
    manifest = {
        "format_version": head["format_version"],
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "input": head["input"],
        "config": head["config"],
        "num_users": fig["num_users"],
        "num_items": fig["num_items"],
        "num_samples": fig["num_samples"],
        "steps": fig["steps"],
        "global_batch": head["config"]["world_size"] * head["config"]["batch_size"],
        "counts": fig["counts"],
        "rejects": by_reason,
        "imbalance": st["imbalance"],
        "over_lower_bound": st["over_lower_bound"],
        "bubble_fraction": st["bubble_fraction"],
        "bubble_fraction_random": fig["bubble_fraction_random"],
        "bubble_fraction_lower_bound": st["bubble_fraction_lower_bound"],
        "total_cost": fig["total_cost"],
        "timings": {k_: round(v, 3) for k_, v in timings.items()},
        "files": files,
    }
    if fig.get("split"):
        manifest["split"] = fig["split"]
    if head["format_version"] == 2:
        manifest["timestamps"] = {"column": schema.TIMESTAMPS, "unit": "s", "input_unit": fig["time_unit"]}
    return manifest


def _remove_stale_temps(out: Path) -> None:
    """Remove temporary folders that a killed build of `out` left behind (this host, dead pid)."""
    prefix = f".{out.name}.tmp-{socket.gethostname()}-"
    for d in out.parent.glob(f"{glob.escape(prefix)}*"):
        pid = d.name[len(prefix) :].split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def _install(tmp: Path, out: Path) -> None:
    """Rename the finished set into place; an old set is moved aside first and removed after."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
