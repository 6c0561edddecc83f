"""The build_shards stage fanned out over Airflow tasks: dataprep.bucketed's stages as a task
group.

The long form: docs/airflow.md, "plugins/ftrec_airflow/shard_tasks"."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from airflow.sdk import Asset, TaskGroup, XComArg, task
from airflow.sdk.exceptions import AirflowFailException

from ftrec_airflow import pipeline_ops

JOB = "job.json"  # in the work folder: the manifest head, budget and buckets (ids and seal read it)


def _user_errors(fn: Callable, *args: Any) -> Any:
    from dataprep.errors import DataprepError

    try:
        return fn(*args)
    except DataprepError as e:
        raise AirflowFailException(str(e)) from None


def _job(spec: pipeline_ops.ShardSpec, log: Callable[[str], None]):
    """dataprep's build.prepare for `spec` (an earlier try's set with other settings is replaced)."""
    from dataprep import build
    from dataprep.errors import DifferentShardSet

    kw = pipeline_ops.shard_build_args(spec, log)
    try:
        return build.prepare(spec.input, spec.fmt, spec.out, **kw)
    except DifferentShardSet:
        return build.prepare(spec.input, spec.fmt, spec.out, overwrite=True, **kw)


def prepare(spec: pipeline_ops.ShardSpec, *, buckets: int | None, memory_budget: str | None, log=print) -> dict:
    """The staging folder of `spec`'s set and the input files' indices (for the mapped tasks)."""
    from dataprep import bucketed

    job = _job(spec, log)
    files = list(range(len(job.paths)))
    if job.existing is not None:
        log(f"{spec.out} already holds this shard set; reused")
        return {"stage": "", "files": files}
    key = hashlib.sha256(json.dumps([job.head, buckets], sort_keys=True).encode()).hexdigest()[:16]
    stage = job.outp.parent / f".{job.outp.name}.stage-{key}"
    work = stage / "_work"
    budget = bucketed.parse_size(memory_budget) if memory_budget else bucketed.default_budget()
    ctx = {**job.bucketed_context(), "batch_rows": bucketed.batch_rows(budget), "budget": budget}
    if not (work / "ctx.json").exists() or json.loads((work / "ctx.json").read_text()) != ctx:
        shutil.rmtree(stage, ignore_errors=True)
        work.mkdir(parents=True)
        (work / JOB).write_text(json.dumps({"head": job.head, "budget": budget, "buckets": buckets}))
        (work / "ctx.json").write_text(json.dumps(ctx))
    log(f"staging {stage}: {len(files)} input files")
    return {"stage": str(stage), "files": files}


def run_stage(name: str, stage: str, index: int | None = None) -> Any:
    """One dataprep.bucketed stage on `stage`, in a child process; None when the set was reused."""
    if not stage:
        return None
    from dataprep import bucketed

    work = str(Path(stage) / "_work")
    args: tuple = (work,) if index is None else (work, index)
    if name == "ids":
        j = json.loads((Path(stage) / "_work" / JOB).read_text())
        args = (work, j["budget"], j["buckets"])
    t = time.monotonic()
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as ex:
        out = _user_errors(lambda: ex.submit(getattr(bucketed, name), *args).result())
    took = time.monotonic() - t
    _took(stage, name, index, took)
    figures = ", ".join(f"{k} {v}" for k, v in out.items() if isinstance(v, int | float) and k != "seconds")
    print(f"dataprep {name}{'' if index is None else f' {index}'}: {figures} ({took:.1f} s)")
    return out


STAGE_TIMINGS = {"read_s": ("scan", "ids"), "sequences_s": ("split", "bucket"), "balance_s": ("plan",)}


def _took(stage: str, name: str, index: int | None, seconds: float) -> None:
    """Record a stage task's seconds (the manifest's timings sum them per stage)."""
    d = Path(stage) / "_work" / "took"
    d.mkdir(exist_ok=True)
    (d / f"{name}-{index}").write_text(repr(seconds))


def _timings(work: Path) -> dict[str, float]:
    took = {f.name: float(f.read_text()) for f in (work / "took").iterdir()} if (work / "took").exists() else {}
    return {k: sum(v for f, v in took.items() if f.split("-")[0] in names) for k, names in STAGE_TIMINGS.items()}


def plan(stage: str, log=print) -> dict | None:
    if not stage:
        return None
    from dataprep import bucketed, workdir

    work = Path(stage) / "_work"
    n = workdir.meta(work / "ids")["buckets"]
    timings: dict[str, float] = {}
    t = time.monotonic()
    out = _user_errors(bucketed.plan, work, n, log, timings)
    _took(stage, "plan", None, time.monotonic() - t)
    return out


def seal(stage: str, out: str, log=print) -> dict[str, Any]:
    """eval, maps, rejects and manifest; the set renamed into place. Returns steps' summary."""
    from dataprep import bucketed, build

    if not stage:
        return {**pipeline_ops._summary(json.loads((Path(out) / "manifest.json").read_text()), out), "reused": True}
    j = json.loads((Path(stage) / "_work" / JOB).read_text())
    t = time.monotonic()
    rejects, fig = bucketed.finish(Path(stage) / "_work")
    timings = _timings(Path(stage) / "_work")
    shutil.rmtree(Path(stage) / "_work")
    m = build.seal(Path(stage), Path(out), j["head"], fig, rejects, timings=timings, t_write=t, t_all=t, say=log)
    return {**pipeline_ops._summary(m, out), "reused": False}


# the mapped tasks: one dataprep.bucketed stage each (fanout calls them inside its task group)
@task
def read(stage: str, f: int) -> Any:
    return run_stage("scan", stage, f)


@task
def partition(stage: str, f: int) -> Any:
    return run_stage("split", stage, f)


@task
def bucket(stage: str, b: int) -> Any:
    return run_stage("bucket", stage, b)


@task
def route(stage: str, b: int) -> Any:
    return run_stage("route", stage, b)


@task
def write(stage: str, r: int) -> Any:
    return run_stage("write", stage, r)


def _settings(params: dict | None, buckets: int | None, memory_budget: str | None) -> dict[str, Any]:
    """The bucket count and memory budget: the DAG run's shard_* params, else the DAG's own."""
    p = params or {}
    return {
        "buckets": p.get("shard_buckets") or buckets,
        "memory_budget": p.get("shard_memory_budget") or memory_budget,
    }


def fanout(
    data: XComArg,
    spec_fn: Callable[..., pipeline_ops.ShardSpec],
    *,
    outlets: list[Asset] | None = None,
    buckets: int | None = None,
    memory_budget: str | None = None,
) -> XComArg:
    """The task group `build_shards` (see the module doc) on `data` (ingest's output); returns
    seal's summary, what `@build_shards_task` returns. `spec_fn(data, params=params)` says the
    set; the shard_buckets and shard_memory_budget params, when set, replace `buckets` and
    `memory_budget`."""
    with TaskGroup(group_id="build_shards"):

        @task(task_id="prepare")
        def prepare_task(data: Any, params=None) -> list[dict]:
            kw = _settings(params, buckets, memory_budget)
            p = _user_errors(lambda: prepare(spec_fn(data, params=params), **kw))
            return [{"stage": p["stage"], "f": f} for f in p["files"]]

        @task
        def ids(files: list[dict]) -> list[dict]:
            stage = files[0]["stage"]
            meta = run_stage("ids", stage)
            return [{"stage": stage, "b": b} for b in range(meta["buckets"] if meta else 1)]

        @task(task_id="plan")
        def plan_task(files: list[dict], data: Any, params=None) -> list[dict]:
            stage = files[0]["stage"]
            plan(stage)
            return [{"stage": stage, "r": r} for r in range(spec_fn(data, params=params).world_size)]

        @task(task_id="seal", outlets=outlets or [])
        def seal_task(files: list[dict], data: Any, params=None, outlet_events=None) -> dict:
            s = seal(files[0]["stage"], spec_fn(data, params=params).out)
            print(
                f"shard set {s['path']}: {s['steps']} steps, {s['num_samples']} samples, "
                f"bubble {s['bubble_fraction'] or 0.0:.4f}{' (reused)' if s['reused'] else ''}"
            )
            for a in outlets or []:
                outlet_events[a].extra = {k: s[k] for k in ("path", "fingerprint", "steps", "num_samples")}
            return s

        files: Any = prepare_task(data)
        scanned = read.expand_kwargs(files)
        buckets_ = ids(files)
        parts = partition.expand_kwargs(files)
        built = bucket.expand_kwargs(buckets_)
        ranks = plan_task(files, data)
        routed = route.expand_kwargs(buckets_)
        written = write.expand_kwargs(ranks)
        sealed = seal_task(files, data)
        scanned >> buckets_ >> parts >> built >> ranks >> routed >> written >> sealed
    return sealed
