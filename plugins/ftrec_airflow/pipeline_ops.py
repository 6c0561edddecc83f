"""What each pipeline task does, as plain functions: no Airflow in here, so they run and test
anywhere, and the DAGs stay thin.

The long form: docs/airflow.md, "plugins/ftrec_airflow/pipeline_ops"."""

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit
from urllib.request import url2pathname

from ftrec_airflow import runner, settings

if TYPE_CHECKING:
    from dataprep.settings import ShardSettings

FORMATS = ("iclrec", "sasrec", "movielens", "events")
SNIFF_LINES = 1000


class UserError(ValueError):
    """Bad input or settings: retrying will not help; the message says what to change."""


class ExactlyOnceBroken(UserError):
    """The job's ledger shows a batch trained twice (or never): the model must not be registered,
    and retrying cannot mend it, so the task fails at once, as on a user error."""


# ---------------------------------------------------------------- ingest_validate


def ingest(
    source: str, fmt: str, run_dir: Path, *, synth_users: int = 2000, synth_items: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """Resolve the data source and check it can be read.

    `source` is a file or folder path or file:// URL under settings.data_roots() (else
    UserError, before anything is opened), "synthetic" (generate data into the run folder) or
    "auto" (the shared Beauty file when present, otherwise synthetic). Returns
    {"path", "format", "bytes", "synthetic"}.
    """
    chosen = source in ("", "auto")  # the deployment's file (FTREC_SHARED_DATA), not the caller's
    if chosen:
        source = settings.default_source()
        if source != "synthetic":
            fmt = "iclrec"  # the shared Beauty file's format
    if source == "synthetic":
        path = Path(run_dir) / "data" / "events.txt"
        if not path.exists():
            from dataprep.synth import write_synthetic  # writes atomically itself

            write_synthetic(str(path), users=synth_users, items=synth_items, seed=seed, fmt="sasrec")
        return {"path": str(path), "format": "sasrec", "bytes": path.stat().st_size, "synthetic": True}

    if fmt not in FORMATS:
        raise UserError(f"param data_format={fmt!r}: use one of {', '.join(FORMATS)}")
    path = Path(source) if chosen else data_path(source)
    if not path.exists():
        raise UserError(
            f"param data_source: {path} does not exist; give a readable file or folder, 'synthetic' or 'auto'"
        )
    if path.is_file():
        if path.stat().st_size == 0:
            raise UserError(f"{path}: the file is empty")
        if fmt in ("iclrec", "sasrec"):
            _sniff_text(path, fmt)
    elif not any(p.is_file() for p in path.rglob("*")):
        raise UserError(f"{path}: the folder holds no files")
    else:
        for p in path.rglob("*"):  # a link in the folder may point outside the roots
            _under_roots(Path(os.path.realpath(p)), str(p))
    size = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return {"path": str(path), "format": fmt, "bytes": size, "synthetic": False}


def data_path(source: str) -> Path:
    """The real path (links and `..` resolved) of a local path or file:// URL that a param or
    an asset event names, refused unless under settings.data_roots(); nothing is opened."""
    url = urlsplit(source)
    if url.scheme == "file":
        if url.netloc not in ("", "localhost"):
            raise UserError(f"param data_source: {source}: a file:// URL on another host; give a local path")
        local = url2pathname(url.path)
    elif "://" in source:
        raise UserError(f"param data_source: {source}: not a local path; give a file or folder, 'synthetic' or 'auto'")
    else:
        local = source
    return _under_roots(Path(os.path.realpath(Path(local).expanduser())), source)


def _under_roots(real: Path, given: str) -> Path:
    roots = settings.data_roots()
    if not any(real.is_relative_to(r) for r in roots):
        raise UserError(
            f"data source {given} (real path {real}) is outside the allowed data roots "
            f"({os.pathsep.join(map(str, roots))}); add its folder to FTREC_DATA_ROOTS to read it"
        )
    return real


def _sniff_text(path: Path, fmt: str) -> None:
    """Check the first lines of a whitespace-separated id file, so that a wrong format fails
    in seconds here rather than later inside dataprep. Errors name the line and field, never
    their text: the file may not be what its poster says (a credentials file, say)."""
    want = "2 fields (user item)" if fmt == "sasrec" else "a user and at least one item"
    first, bad, lines = None, 0, 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if n > SNIFF_LINES:
                break
            fields = line.split()
            if not fields:
                continue
            ok = len(fields) == 2 if fmt == "sasrec" else len(fields) >= 2
            if not ok:
                raise UserError(
                    f"{path}, line {n}: format {fmt} expects {want}, found {len(fields)} "
                    f"field(s); set param data_format to the file's format"
                )
            lines += 1
            col = next((k for k, v in enumerate(fields, 1) if not (v.isascii() and v.lstrip("+").isdigit())), None)
            if col is not None:
                first, bad = first or (n, col), bad + 1
    _check_ids(path, fmt, first, bad, lines)


def _check_ids(path: Path, fmt: str, first: tuple[int, int] | None, bad: int, lines: int) -> None:
    """Fail when more of the sniffed lines hold a non-integer id than dataprep would reject."""
    from dataprep.rejects import MAX_REJECT_FRACTION

    if first and bad > MAX_REJECT_FRACTION * lines:
        raise UserError(
            f"{path}, line {first[0]}, field {first[1]}: format {fmt} expects integer ids "
            f"({bad} of the first {lines} lines have another value); is this the right file and data_format?"
        )


# ---------------------------------------------------------------- build / verify shards


@dataclass
class ShardSpec:
    """A shard set to build: what `@build_shards_task` functions return."""

    input: str
    fmt: str
    out: str
    world_size: int
    batch_size: int = 64
    max_len: int = 50
    seed: int = 0
    window_steps: int | None = None
    # the trainer's `model.KEY=VALUE` settings: the shards are balanced with that model's cost
    # model, calibrated once per model and machine (training/calibrate.py); None: dataprep's default
    model_overrides: list[str] | None = None
    # dataprep's split: leave_one_out, or temporal at `cut` (epoch seconds) testing up to `horizon`
    # seconds after it (None: dataprep's defaults); the run's: eval_split.resolve
    split: str = "leave_one_out"
    cut: int | None = None
    horizon: int | None = None


def _summary(manifest: dict, path: str | Path) -> dict[str, Any]:
    keys = ("num_users", "num_items", "num_samples", "steps", "bubble_fraction", "imbalance", "config")
    out = {k: manifest.get(k) for k in keys}
    out["cost_model"] = (manifest.get("config") or {}).get("cost_model", {}).get("source")
    out["path"] = str(path)
    out["fingerprint"] = manifest.get("input", {}).get("fingerprint")
    return out


def shard_settings(spec: ShardSpec, log=print) -> "ShardSettings":
    """dataprep's settings record for `spec`, the one-process build's and the fanned-out one's
    alike; the cost model is the trained model's own, calibrated once per model config and
    machine (None: dataprep's default). DataprepError: a setting dataprep refuses."""
    from dataprep.settings import ShardSettings

    cost_model = None
    if spec.model_overrides is not None:
        cost_model = _calibrated(spec)
        if log:
            log(f"cost model: {cost_model}")
    keys = ("world_size", "batch_size", "seed", "max_len", "window_steps", "split", "cut", "horizon")
    return ShardSettings(**{k: getattr(spec, k) for k in keys}, cost_model=cost_model)


def _calibrated(spec: ShardSpec) -> str:
    """The cost model file of `spec`'s model (training.calibrate.cached), copied beside its shard
    set, and that copy from then on: a noisy calibration is not cached machine-wide, so a retry
    of the same build would time the model again, balance by other figures and rebuild the set
    it should reuse. The copy is named by the model and max_len; another model calibrates afresh."""
    from ftcore.util.files import atomic_write_text
    from training import calibrate

    out = Path(spec.out)
    doc = json.dumps({"model": sorted(spec.model_overrides or []), "max_len": spec.max_len}, sort_keys=True)
    pin = out.parent / f".{out.name}.cost-model-{hashlib.sha256(doc.encode()).hexdigest()[:16]}.json"
    if not pin.is_file():
        path = calibrate.cached(
            calibrate.model_config(spec.model_overrides or []), spec.max_len, settings.work_root() / "cost-models"
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(pin, Path(path).read_text())
    return str(pin)


def build_shards(spec: ShardSpec, log=None) -> dict[str, Any]:
    """Build the shard set unless the same one is already there; return its summary.

    dataprep itself returns an identical existing set without rebuilding; a set left by an
    earlier try with another input or other settings is replaced, never mixed."""
    from dataprep.build import build_shards as _build
    from dataprep.errors import DataprepError, DifferentShardSet

    out = Path(spec.out)
    manifest_path = out / "manifest.json"

    def identity():  # a rebuilt set is renamed into place: a new inode
        st = manifest_path.stat() if manifest_path.exists() else None
        return st and (st.st_ino, st.st_mtime_ns)

    before = identity()
    try:
        record = shard_settings(spec, log)
        try:
            manifest = _build(spec.input, spec.fmt, str(out), record, quiet=True, log=log)
        except DifferentShardSet:  # an earlier try's set with other settings: replace it, nothing else
            manifest = _build(spec.input, spec.fmt, str(out), record, quiet=True, log=log, overwrite=True)
    except DataprepError as e:
        raise UserError(str(e)) from None
    reused = before is not None and before == identity()
    return {**_summary(manifest, out), "reused": reused}


def check_shards(path: str) -> dict[str, Any]:
    """Check checksums, schema and coverage of a shard set (dataprep's verify)."""
    from dataprep.errors import DataprepError
    from dataprep.verify import verify_shards as _verify

    try:
        manifest = _verify(path)
    except DataprepError as e:
        raise UserError(str(e)) from None
    return _summary(manifest, path)


# ---------------------------------------------------------------- train


@dataclass
class TrainSpec:
    """A training run: what `@ft_train_task` functions return.

    `overrides` are trainer settings `section.key=value` (training/config.py)."""

    shards: str
    out: str
    replica_groups: int = 1
    ranks_per_group: int = 1
    fault_plan: str = ""  # path to a TOML/JSON fault plan, or inline JSON
    max_steps: int = 0
    epochs: int = 0  # 0: the trainer's default
    experiment: str = settings.DEFAULT_EXPERIMENT
    run_name: str = ""
    run_key: str = ""  # identifies the Airflow task's run: a retry finds the same MLflow run
    overrides: list[str] = field(default_factory=list)
    timeout_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class TrainedRun:
    """What training produced: the train task's XCom (`to_dict`, JSON-able), read back by
    evaluate, register_model and the chaos drill (`from_dict`). The local launcher and the
    Kubernetes pods both report one (`of`)."""

    mlflow_run_id: str
    experiment_id: str = ""
    run_url: str = ""
    tracking_uri: str
    out: str = ""
    shards: str
    checkpoint: str | None
    steps: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    replica_groups: int = 1
    ranks_per_group: int = 1
    fault_plan: str = ""
    reused: bool = False

    @classmethod
    def of(cls, spec: TrainSpec, result: dict[str, Any], **run: str) -> "TrainedRun":
        """From the spec trained and the trainer's result.json; `run`: mlflow_run_id,
        experiment_id, run_url, tracking_uri."""
        return cls(
            **run,
            out=spec.out,
            shards=spec.shards,
            checkpoint=result.get("checkpoint"),
            steps=result.get("steps"),
            metrics=result.get("metrics", {}),
            replica_groups=spec.replica_groups,
            ranks_per_group=spec.ranks_per_group,
            fault_plan=spec.fault_plan,
            reused=result.get("reused", False),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainedRun":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _fault_plan_file(spec: TrainSpec) -> str:
    plan = spec.fault_plan.strip() if isinstance(spec.fault_plan, str) else json.dumps(spec.fault_plan)
    if not plan:
        return ""
    if plan.startswith(("{", "[")):
        try:
            json.loads(plan)
        except json.JSONDecodeError as e:
            raise UserError(f"param fault_plan: inline JSON does not parse ({e.msg} at column {e.colno})") from None
        from ftcore.util.files import atomic_write_text

        path = Path(spec.out) / "fault_plan.json"
        atomic_write_text(path, plan)
        return str(path)
    if not Path(plan).is_file():
        raise UserError(f"param fault_plan: {plan} is not a file; give a TOML/JSON plan file or inline JSON")
    return plan


def trainer_settings(spec: TrainSpec, run_id: str, tracking_uri: str) -> list[str]:
    """The `--set section.key=value` settings every rank's trainer gets for this run
    (on the local launcher and in the Kubernetes pods alike)."""
    out = Path(spec.out)
    sets = [
        f"mlflow.run_id={run_id}",
        f"mlflow.experiment={spec.experiment}",
        f"mlflow.tracking_uri={tracking_uri}",
        "mlflow.register=false",
    ]  # registration is the register_model task's, behind the gate
    if spec.max_steps:
        sets.append(f"train.max_steps={spec.max_steps}")
    if spec.epochs:
        sets.append(f"train.epochs={spec.epochs}")
    if any(out.glob("checkpoints/step-*")) or any(out.glob("replica_*/checkpoints/step-*")):
        sets.append("train.resume=true")  # a retry continues from its last checkpoint
    return sets + list(spec.overrides)


def train_command(spec: TrainSpec, run_id: str, tracking_uri: str) -> list[str]:
    """The command line of one training run: the ftcore launcher (`python -m training launch`),
    R replica groups of K ranks, even for one group of one rank."""
    out = Path(spec.out)
    cmd = [
        sys.executable,
        "-m",
        "training",
        "launch",
        "--shards",
        spec.shards,
        "--replica-groups",
        str(spec.replica_groups),
        "--ranks-per-group",
        str(spec.ranks_per_group),
        "--out",
        str(out),
    ]
    if spec.timeout_s:  # its own bound too: it outlives a task process that dies without a word
        cmd += ["--timeout", str(spec.timeout_s)]
    plan = _fault_plan_file(spec)
    if plan:
        cmd += ["--faults", plan]
    standing = settings.lighthouse_url()
    if standing:
        # Join the standing lighthouse under this run's own job id; the launcher passes the
        # token this worker holds (FTCORE_TOKEN_FILE / FTCORE_TOKEN) to every rank.
        cmd += [
            "--lighthouse",
            standing.removeprefix("http://"),
            "--job-id",
            settings.lighthouse_job_id(spec.run_key or str(out)),
        ]
    cmd.append("--")  # what follows goes to every rank's trainer
    for s in trainer_settings(spec, run_id, tracking_uri):
        cmd += ["--set", s]
    return cmd


def trainer_out(out: str | Path) -> Path:
    """Where the trainer of replica group 0 writes (checkpoints/, result.json): the
    launcher gives each group OUT/replica_<g>/."""
    return Path(out) / "replica_0"


def read_result(out: str | Path) -> dict[str, Any] | None:
    path = trainer_out(out) / "result.json"
    return json.loads(path.read_text()) if path.exists() else None


def train_env(tracking_uri: str, credentials: dict[str, str] | None = None) -> dict[str, str]:
    """The training processes' environment: the task's, the tracking URI, and the MLflow
    credentials (MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN) in the environment, never on the
    command line, which the task log shows."""
    return {**os.environ, **(credentials or {}), "MLFLOW_TRACKING_URI": tracking_uri}


def run_training(
    spec: TrainSpec,
    run_id: str,
    tracking_uri: str,
    *,
    credentials: dict[str, str] | None = None,
    command_hook=None,
    logger=None,
    on_line=None,
) -> dict[str, Any]:
    """Run training into `spec.out` on MLflow run `run_id`; return the trainer's result.json.

    Idempotent: a finished result for the same MLflow run is returned as is; a run that
    stopped midway resumes from its newest checkpoint on the same MLflow run.
    `command_hook(cmd)` receives the `runner.Command` before it starts (for on_kill)."""
    done = read_result(spec.out)
    if done and done.get("mlflow_run_id") == run_id:
        check_exactly_once(spec, done, logger)
        return {**done, "reused": True}
    Path(spec.out).mkdir(parents=True, exist_ok=True)
    from ftrec_airflow import tries

    with tries.recorded(spec.out, logger.warning if logger else print):  # and what ended the try before
        followed = _follow_live_job(spec, run_id, logger, command_hook)
        if followed is not None:
            return followed
        from ftrec_airflow import follow

        cmd = runner.Command(  # detached: the job outlives a task process lost without a word
            train_command(spec, run_id, tracking_uri),
            logger=logger,
            on_line=on_line,
            env=train_env(tracking_uri, credentials),
            log_file=Path(spec.out) / follow.LOG_NAME,
        )
        if command_hook:
            command_hook(cmd)
        cmd.run(spec.timeout_s)
    result = read_result(spec.out)
    if result is None:
        raise RuntimeError(
            f"training exited 0 but wrote no {trainer_out(spec.out) / 'result.json'}: replica group 0 writes it, "
            "and a group 0 that first reached the lighthouse after the other groups had finished the job (its "
            "log says 'the job finished at step N') has nothing to report; retry the task, and if its start "
            "is that slow raise FTCORE_START_TIMEOUT"
        )
    check_exactly_once(spec, result, logger)
    return {**result, "reused": False}


def _follow_live_job(spec: TrainSpec, run_id: str, logger, command_hook) -> dict[str, Any] | None:
    """When an earlier try's job still runs in `spec.out`: follow it to its end (the task's
    on_kill stops it) and return its result, or None to start (resume) the job here."""
    from ftrec_airflow import follow

    holder = follow.live_job(spec.out)
    if holder is None:
        return None
    say = logger.warning if logger else print
    follower = follow.Follower(spec.out, holder, say, echo=logger.info if logger else print)
    if command_hook:
        command_hook(follower)
    follower.wait(spec.timeout_s)
    done = read_result(spec.out)
    if done and done.get("mlflow_run_id") == run_id:
        check_exactly_once(spec, done, logger)
        return {**done, "reused": True}
    say("the followed job ended without a result: resuming it from its checkpoints")
    return None


def check_exactly_once(spec: TrainSpec, result: dict[str, Any], logger=None) -> dict[str, Any]:
    """ftcore.ledger.check on the job's ledger (OUT/ledger): no batch trained twice, and every
    batch of every epoch the run completed trained once (a step budget may end the last one
    midway). Returns the check's summary; raises ExactlyOnceBroken, so that a run that broke
    exactly-once never ends green."""
    import math

    from ftcore import ledger

    folder = Path(spec.out) / "ledger"
    manifest = Path(spec.shards) / "manifest.json"
    done = float(result.get("epochs_completed") or 0.0)
    epochs = math.ceil(done - 1e-9)
    try:
        steps = int(json.loads(manifest.read_text())["steps"])
        if not folder.is_dir():
            raise ledger.LedgerError(f"{folder} is missing: every rank of the launcher's groups writes there")
        summary = ledger.check(
            str(folder),
            steps_per_epoch=steps,
            num_groups=spec.replica_groups,
            ranks_per_group=spec.ranks_per_group,
            epochs=epochs,
            partial_last=done < epochs,
        )
    except (ledger.LedgerError, OSError, KeyError, ValueError) as e:
        raise ExactlyOnceBroken(
            f"ledger check failed in {folder}: {e}. A batch was trained more than once (or never), so this "
            "model is not registered; the ledger's records and timeline.json there say which steps; "
            "trigger a new DAG run to train again"
        ) from None
    (logger.info if logger else print)(
        f"ledger check passed: {summary['steps']} committed steps, {summary['batches']} batches, each trained "
        f"once ({done:g} epochs of {steps} steps)"
    )
    return summary


# ---------------------------------------------------------------- evaluate


def judge(
    checkpoint: str,
    shards: str,
    out_json: str,
    *,
    champion: str = "",
    logger=None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Score the new checkpoint, and the champion's when given, with the same evaluation on
    the shard set's test split (`python -m training.gate`); returns its JSON:
    {"metrics": {name: value}, "champion": {name: value} | None, "champion_error", "split"}.

    The result file is written atomically (whole or not at all), so a retry after it exists
    does no work."""
    out = Path(out_json)
    if not out.exists():
        cmd = [sys.executable, "-m", "training.gate", "--shards", shards, "--challenger", checkpoint]
        runner.run([*cmd, "--champion", champion, "--out", str(out)], logger=logger, timeout_s=timeout_s)
    data = json.loads(out.read_text())
    data["metrics"] = {k: float(v) for k, v in data.get("metrics", data).items() if isinstance(v, (int, float))}
    return data


# ---------------------------------------------------------------- quality gate


class GateFailed(Exception):
    """The model did not reach the quality gate; the message lists the metrics."""


def check_gate(metrics: dict[str, float], metric: str, minimum: float) -> float:
    """Return the gated metric's value; raise GateFailed (or UserError for an unknown
    metric) with every metric in the message."""
    from ftrec_airflow.mlflow_registry import metric_key

    shown = ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))
    metrics = {metric_key(k): v for k, v in metrics.items()}
    if metric_key(metric) in metrics:
        metric = metric_key(metric)
    if metric not in metrics:
        raise UserError(f"param gate_metric={metric!r} is not among the evaluation metrics: {shown}")
    value = metrics[metric]
    if not value >= minimum:
        raise GateFailed(f"quality gate failed: {metric}={value:.4f} < {minimum}; metrics: {shown}")
    return value


def metric_pair(metric: str) -> tuple[str, str]:
    """(the gate metric, its secondary twin under the other protocol), MLflow spelling:
    test/full/ndcg_at_10 -> test/sampled/ndcg_at_10 and back."""
    from ftrec_airflow.mlflow_registry import metric_key

    m = metric_key(metric)
    other = m.replace("/full/", "/sampled/") if "/full/" in m else m.replace("/sampled/", "/full/")
    return m, other


def verdict(challenger: float, champion: float | None, min_margin: float, error: str | None = None) -> tuple[bool, str]:
    """Promote the challenger? Both values come from the same evaluation on the same split.
    It must beat the champion by at least `min_margin` (and strictly); a champion that could
    not be re-scored is kept (a number from another test decides nothing)."""
    if error:
        return False, f"the champion could not be scored on this split ({error}): keeping it"
    if champion is None:
        return True, f"no champion yet: first champion at {challenger:.6f}"
    won = challenger > champion and challenger - champion >= min_margin
    rel = ">=" if won else "<"
    return won, f"challenger {challenger:.6f} {rel} champion {champion:.6f} + margin {min_margin} on the same split"
