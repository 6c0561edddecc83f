"""The build_shards stage fanned out over Airflow tasks: dataprep.bucketed's stages as a task
group.

The long form: docs/airflow.md, "plugins/ftrec_airflow/shard_tasks"."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow.sdk import Asset, TaskGroup, XComArg, task
from airflow.sdk.exceptions import AirflowFailException

from ftrec_airflow import pipeline_ops
from ftrec_airflow.run_params import RunParams

JOB = "job.json"  # in the work folder: the manifest head, budget and buckets (ids and seal read it)


def _user_errors(fn: Callable, *args: Any) -> Any:
    from dataprep.errors import DataprepError

    try:
        return fn(*args)
    except (DataprepError, pipeline_ops.UserError) as e:
        raise AirflowFailException(str(e)) from None


@dataclass(frozen=True)
class PoolCalibration:
    """The cost model timed on the training pool before the build (FreeScale: calibrated where
    it trains): `operator(task_id=)` a partial pod operator, `kwargs(spec)` its mapped kwargs,
    `pool` the name it publishes the file under (training/calibrate.py, `--pool`)."""

    operator: Callable[..., Any]
    kwargs: Callable[[pipeline_ops.ShardSpec], dict[str, Any]]
    pool: str


def pool_cost_model(spec: pipeline_ops.ShardSpec, pool: str, log: Callable[[str], None] = print) -> str:
    """The cost model file the training pool `pool` published for `spec`'s model and max_len."""
    from ftrec_airflow import settings
    from training import calibrate

    cfg = calibrate.model_config(spec.model_overrides or [])
    try:
        path = calibrate.from_pool(settings.work_root() / "cost-models", cfg, spec.max_len, pool)
    except FileNotFoundError as e:
        raise AirflowFailException(str(e)) from None
    log(f"cost model: {path} (timed on the training pool {pool!r})")
    return path


def _job(spec: pipeline_ops.ShardSpec, log: Callable[[str], None], cost_model: str | None = None):
    """dataprep's build.prepare for `spec` (an earlier try's set with other settings is replaced);
    `cost_model`: a file timed elsewhere (the training pool), instead of calibrating here."""
    from dataprep import build
    from dataprep.errors import DifferentShardSet

    if cost_model is not None:
        spec = dataclasses.replace(spec, model_overrides=None)
    record = pipeline_ops.shard_settings(spec, log)
    if cost_model is not None:
        record = dataclasses.replace(record, cost_model=cost_model)
    try:
        return build.prepare(spec.input, spec.fmt, spec.out, record)
    except DifferentShardSet:
        return build.prepare(spec.input, spec.fmt, spec.out, record, overwrite=True)


def prepare(
    spec: pipeline_ops.ShardSpec, *, buckets: int | None, memory_budget: str | None, log=print, pool: str | None = None
) -> dict:
    """The staging folder of `spec`'s set and the indices of its input spans (each file, or a
    run of a large Parquet file's row groups: readers.spans), which the read and partition
    tasks are mapped over. `pool`: balance by the cost model that training pool published."""
    from dataprep import bucketed

    job = _job(spec, log, pool_cost_model(spec, pool, log) if pool else None)
    if job.existing is not None:
        log(f"{spec.out} already holds this shard set; reused")
        return {"stage": "", "spans": list(range(len(job.paths)))}
    key = hashlib.sha256(json.dumps([job.head, buckets], sort_keys=True).encode()).hexdigest()[:16]
    stage = job.outp.parent / f".{job.outp.name}.stage-{key}"
    work = stage / "_work"
    budget = bucketed.parse_size(memory_budget) if memory_budget else bucketed.default_budget()
    ctx = {**job.bucketed_context(), "batch_rows": bucketed.batch_rows(budget), "budget": budget}
    spans = list(range(len(ctx["spans"])))
    if not (work / "ctx.json").exists() or json.loads((work / "ctx.json").read_text()) != ctx:
        shutil.rmtree(stage, ignore_errors=True)
        work.mkdir(parents=True)
        (work / JOB).write_text(json.dumps({"head": job.head, "budget": budget, "buckets": buckets}))
        (work / "ctx.json").write_text(json.dumps(ctx))
    log(f"staging {stage}: {len(job.paths)} input files in {len(spans)} spans")
    return {"stage": str(stage), "spans": spans}


def run_stage(name: str, stage: str, index: int | None = None) -> Any:
    """One dataprep.bucketed stage on `stage`, in a child process; None when the set was reused."""
    if not stage:
        return None
    work = str(Path(stage) / "_work")
    args: tuple = (work,) if index is None else (work, index)
    if name == "ids":
        j = json.loads((Path(stage) / "_work" / JOB).read_text())
        args = (work, j["budget"], j["buckets"])
    t = time.monotonic()
    out = _user_errors(_in_child, name, args)
    took = time.monotonic() - t
    _took(stage, name, index, took)
    figures = ", ".join(f"{k} {v}" for k, v in out.items() if isinstance(v, int | float) and k != "seconds")
    print(f"dataprep {name}{'' if index is None else f' {index}'}: {figures} ({took:.1f} s)")
    return out


# A stage's child: a fresh interpreter that imports dataprep alone. (A multiprocessing "spawn"
# child re-runs the parent's __main__, which under Airflow's scheduler is the `airflow` command:
# it initialises Airflow without the database settings a task is not given, and dies.)
_CHILD = """import json, sys
from dataprep import bucketed
from dataprep.errors import DataprepError
try:
    out = getattr(bucketed, sys.argv[1])(*json.loads(sys.argv[2]))
except DataprepError as e:
    print(json.dumps({"dataprep_error": str(e)}))
    sys.exit(3)
print(json.dumps(out))
"""


def _in_child(name: str, args: tuple) -> dict:
    """dataprep.bucketed's stage `name`(*args) in a child process: its memory ends with it."""
    from dataprep.errors import DataprepError

    p = subprocess.run([sys.executable, "-c", _CHILD, name, json.dumps(args)], capture_output=True, text=True)
    last = p.stdout.strip().rsplit("\n", 1)[-1] if p.stdout.strip() else ""
    if p.returncode == 3:
        raise DataprepError(json.loads(last)["dataprep_error"])
    if p.returncode != 0:
        raise RuntimeError(f"dataprep stage {name} exited {p.returncode}: {p.stderr[-2000:]}")
    return json.loads(last)


STAGE_TIMINGS = {"read_s": ("scan", "ids"), "sequences_s": ("split", "bucket"), "balance_s": ("plan",)}


def _took(stage: str, name: str, index: int | None, seconds: float) -> None:
    from dataprep import workdir

    workdir.took(Path(stage) / "_work", name, index, seconds)


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


# the mapped tasks: one dataprep.bucketed stage each (fanout calls them inside its task group).
# Each takes `arguments` [work folder ("": the set was reused), index], what `python -m dataprep
# stage NAME` takes: a task here or a pod (fanout's `pods`) is mapped over the same list.
def _args(stage: str, indices) -> list[dict]:
    return [{"arguments": [str(Path(stage) / "_work") if stage else "", str(i)]} for i in indices]


def _stage(work: str) -> str:
    return str(Path(work).parent) if work else ""


@task
def read(arguments: list[str]) -> Any:
    return run_stage("scan", _stage(arguments[0]), int(arguments[1]))


@task
def partition(arguments: list[str]) -> Any:
    return run_stage("split", _stage(arguments[0]), int(arguments[1]))


@task
def bucket(arguments: list[str]) -> Any:
    return run_stage("bucket", _stage(arguments[0]), int(arguments[1]))


@task
def route(arguments: list[str]) -> Any:
    return run_stage("route", _stage(arguments[0]), int(arguments[1]))


@task
def write(arguments: list[str]) -> Any:
    return run_stage("write", _stage(arguments[0]), int(arguments[1]))


MAPPED = {"read": ("scan", read), "partition": ("split", partition), "bucket": ("bucket", bucket)}
MAPPED |= {"route": ("route", route), "write": ("write", write)}


def _settings(params: Mapping[str, Any] | None, buckets: int | None, memory_budget: str | None) -> dict[str, Any]:
    """The bucket count and memory budget: the DAG run's shard_* params, else the DAG's own."""
    p = RunParams.of(params)
    return {"buckets": p.shard_buckets or buckets, "memory_budget": p.shard_memory_budget or memory_budget}


def _announce(s: dict[str, Any], outlets: list[Asset], outlet_events: Any) -> None:
    """seal's log line, and the shard set (path, fingerprint, size) on its outlets' events."""
    print(
        f"shard set {s['path']}: {s['steps']} steps, {s['num_samples']} samples, "
        f"bubble {s['bubble_fraction'] or 0.0:.4f}{' (reused)' if s['reused'] else ''}"
    )
    for a in outlets:
        outlet_events[a].extra = {k: s[k] for k in ("path", "fingerprint", "steps", "num_samples")}


def _calibrate_task(calibrate: PoolCalibration, spec_fn: Callable[..., pipeline_ops.ShardSpec], data: XComArg) -> Any:
    """build_shards.calibrate: the pool's pod (mapped over one kwargs dict, from the run's params)."""

    @task(task_id="calibrate_args")
    def calibrate_args(data: Any, params=None) -> list[dict]:
        return [calibrate.kwargs(spec_fn(data, params=params))]

    return calibrate.operator(task_id="calibrate").expand_kwargs(calibrate_args(data))


def fanout(
    data: XComArg,
    spec_fn: Callable[..., pipeline_ops.ShardSpec],
    *,
    outlets: list[Asset] | None = None,
    buckets: int | None = None,
    memory_budget: str | None = None,
    pods: Callable[..., Any] | None = None,
    calibrate: PoolCalibration | None = None,
) -> XComArg:
    """The task group `build_shards` (see the module doc) on `data` (ingest's output); returns
    seal's summary, what `@build_shards_task` returns. `spec_fn(data, params=params)` says the
    set; the shard_buckets and shard_memory_budget params, when set, replace `buckets` and
    `memory_budget`. `pods(task_id=, stage=)`: the mapped stages as pods (a partial operator);
    `calibrate`: a pod on the training pool times the cost model first, and prepare reads it."""
    with TaskGroup(group_id="build_shards"):

        @task(task_id="prepare")
        def prepare_task(data: Any, params=None) -> list[dict]:
            kw = _user_errors(_settings, params, buckets, memory_budget)
            pool = calibrate.pool if calibrate else None
            p = _user_errors(lambda: prepare(spec_fn(data, params=params), pool=pool, **kw))
            return _args(p["stage"], p["spans"])

        @task
        def ids(files: list[dict]) -> list[dict]:
            stage = _stage(files[0]["arguments"][0])
            meta = run_stage("ids", stage)
            return _args(stage, range(meta["buckets"] if meta else 1))

        @task(task_id="plan")
        def plan_task(files: list[dict], data: Any, params=None) -> list[dict]:
            stage = _stage(files[0]["arguments"][0])
            plan(stage)
            return _args(stage, range(spec_fn(data, params=params).world_size))

        @task(task_id="seal", outlets=outlets or [])
        def seal_task(files: list[dict], data: Any, params=None, outlet_events=None) -> dict:
            s = seal(_stage(files[0]["arguments"][0]), spec_fn(data, params=params).out)
            _announce(s, outlets or [], outlet_events)
            return s

        def mapped(task_id: str, over: Any) -> Any:
            name, fn = MAPPED[task_id]
            return (pods(task_id=task_id, stage=name) if pods else fn).expand_kwargs(over)

        files: Any = prepare_task(data)
        if calibrate is not None:
            _calibrate_task(calibrate, spec_fn, data) >> files
        scanned = mapped("read", files)
        buckets_ = ids(files)
        parts = mapped("partition", files)
        built = mapped("bucket", buckets_)
        ranks = plan_task(files, data)
        routed = mapped("route", buckets_)
        written = mapped("write", ranks)
        sealed = seal_task(files, data)
        scanned >> buckets_ >> parts >> built >> ranks >> routed >> written >> sealed
    return sealed
