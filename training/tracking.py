"""MLflow tracking that never slows or kills training.

One `Tracker` per run, on rank 0. A call only queues an operation; a background thread
sends it with retries, keeps what cannot be sent in order, and `close()` flushes with a
time bound and reports what is unsent instead of raising. Store: mlflow.tracking_uri,
else MLFLOW_TRACKING_URI, else sqlite:///<out>/mlflow.db.
"""

import importlib.metadata
import json
import logging
import os
import queue
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from ftcore.util.files import atomic_write_text
from training.config import MlflowConfig

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

log = logging.getLogger("training.tracking")

RETRY_ATTEMPTS = int(os.environ.get("FTREC_MLFLOW_RETRIES", "3"))
RETRY_PAUSE_S = float(os.environ.get("FTREC_MLFLOW_RETRY_PAUSE_S", "2.0"))  # between rounds over the buffer
HTTP_TIMEOUT_S = os.environ.get("FTREC_MLFLOW_HTTP_TIMEOUT_S", "5")
# system/* metrics every 10 s: enough to see CPU, memory, GPU over a run at a negligible cost
# (MLflow's MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL overrides it)
SYSTEM_METRICS_INTERVAL_S = 10.0
MONITOR_CHECK_S = float(os.environ.get("FTREC_MLFLOW_MONITOR_CHECK_S", "30"))  # is the system-metrics thread alive?


# Errors a retry cannot fix: the op is dropped (and reported) instead of blocking the queue.
RUN_FILE = "mlflow_run_id"  # in the trainer's output folder: the run this job logs into
PENDING = "pending:"  # ... or, while that run is created, this and the token it is tagged with
TOKEN_TAG = "ftrec.run_token"

PERMANENT = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE"}


def metric_name(name: str) -> str:
    """MLflow refuses '@' in names: hr@10 is logged as hr_at_10."""
    return name.replace("@", "_at_")


def resolve_uri(cfg: MlflowConfig, out: str) -> tuple[str, str | None]:
    """(tracking URI, artifact location for a new experiment or None for the server's default)."""
    uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri:
        return uri, None
    out = os.path.abspath(out)
    return f"sqlite:///{os.path.join(out, 'mlflow.db')}", "file://" + os.path.join(out, "mlartifacts")


def code_tags() -> dict[str, str]:
    """ftrec.version, and ftrec.git_commit when the code is a git checkout."""
    tags = {}
    try:
        tags["ftrec.version"] = importlib.metadata.version("ftrec")
    except importlib.metadata.PackageNotFoundError:
        pass
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        r = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        lines = r.stdout.splitlines()
        # the checkout must be ftrec's own, not some repository an installed copy happens to lie in
        if r.returncode == 0 and len(lines) == 2 and os.path.samefile(lines[0], root):
            tags["ftrec.git_commit"] = lines[1]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return tags


def _transient(e: BaseException) -> bool:
    return getattr(e, "error_code", None) not in PERMANENT


@dataclass
class _Op:
    name: str
    fn: Callable[[Any, str], None]  # fn(client, run_id)
    tries: int = field(default=0)


class Tracker:
    """Asynchronous, failure-tolerant MLflow logging for one run."""

    def __init__(self, cfg: MlflowConfig, out: str, continue_recorded: bool = False):
        self.cfg = cfg
        self.uri, self._artifact_location = resolve_uri(cfg, out)
        self._out = out
        self._continue = continue_recorded  # a restarted group of a running job: its run, not a new one
        self.run_id: str | None = None
        self.errors: list[str] = []
        self.dropped = 0  # ops the server refused as invalid (not retried)
        self._q: queue.Queue[_Op | None] = queue.Queue()
        self._buffer: list[_Op] = []  # ops that failed, retried in order before new ones
        # MLflow's own HTTP retries would block for minutes on a dead server; tenacity decides here.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", HTTP_TIMEOUT_S)
        self._client: MlflowClient | None = None
        self._monitor: SystemMetricsMonitor | None = None  # sampling system metrics, once the run exists
        self._logged: dict[str, int] = {}  # a continued run's last step per metric, before this process
        self._next_check = time.monotonic() + MONITOR_CHECK_S  # when _revive_monitor looks next
        self._thread = threading.Thread(target=self._work, name="mlflow-tracker", daemon=True)
        self._thread.start()

    # ---- public API: all non-blocking -------------------------------------------------
    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            chunk = items[i : i + 100]
            self._put("params", lambda c, r, chunk=chunk: c.log_batch(r, params=chunk))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(metric_name(k), float(v), ts, step) for k, v in metrics.items()]
        self._put("metrics", lambda c, r: self._send_metrics(c, r, items))

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)) for k, v in tags.items()]
        self._put("tags", lambda c, r: c.log_batch(r, tags=items))

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self._put("artifact", lambda c, r: c.log_artifact(r, path, artifact_path))

    def log_input(self, name: str, digest: str, source: str, profile: dict, context: str = "train") -> None:
        """The run's dataset (mlflow.log_input's record): metadata only, the data stays at `source`."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        # the record MetaDataset(LocalArtifactDatasetSource(source)) would make, plus the profile
        ds = Dataset(name, digest, "local", json.dumps({"uri": source}), profile=json.dumps(profile))
        item = DatasetInput(ds, [InputTag("mlflow.data.context", context)])
        self._put("input", lambda c, r: c.log_inputs(r, datasets=[item]))

    def log_model(self, exported: dict, register: bool, name: str) -> None:
        """Log a training.serving export as the run's pyfunc "model" (registered as `name` when asked)."""

        def send(client, run_id):
            import mlflow

            from training import serving

            mlflow.set_tracking_uri(self.uri)
            with mlflow.start_run(run_id=run_id):
                serving.log_pyfunc(exported, registered_model_name=name if register else None)

        self._put("model", send)

    def close(self, status: str = "FINISHED", timeout: float = 120.0) -> int:
        """Flush with a time bound; returns how many operations could not be sent."""

        def end(client, run_id):
            if self._monitor:
                self._monitor.finish()  # stop sampling and flush, while the run still takes metrics
                self._monitor = None
            client.set_terminated(run_id, status)

        self._put("end", end)
        self._q.put(None)
        self._thread.join(timeout)
        unsent = self._q.qsize() + len(self._buffer) + (1 if self._thread.is_alive() else 0)
        if unsent:
            log.warning(
                "mlflow: %d operation(s) not sent to %s (%s)",
                unsent,
                self.uri,
                self.errors[-1] if self.errors else "timed out",
            )
        return unsent

    # ---- background thread ----------------------------------------------------------
    def _put(self, name: str, fn) -> None:
        self._q.put(_Op(name, fn))

    def _start_run(self) -> str:
        from mlflow import MlflowClient

        client = MlflowClient(self.uri)
        recorded = self._recorded_run(client) if self._continue and not self.cfg.run_id else ""
        run_id = self.cfg.run_id or recorded
        if run_id:
            run = client.get_run(run_id)  # a retried task, or a restarted group 0, continues its run
            client.update_run(run.info.run_id, status="RUNNING")
            run_id = run.info.run_id
            # its newest point per metric: a resumed job redoes the steps after its checkpoint, and
            # those it had logged before are not logged twice (_send_metrics)
            self._logged = {m.key: m.step for m in getattr(run.data, "_metric_objs", [])}
            if recorded:  # the file may hold a pending marker its recorder died with: the id now
                self._record_run(run_id)
        else:
            exp = client.get_experiment_by_name(self.cfg.experiment)
            exp_id = (
                exp.experiment_id
                if exp
                else client.create_experiment(self.cfg.experiment, artifact_location=self._artifact_location)
            )
            # recorded before it exists: a group killed while the run is created finds it by this tag
            token = uuid.uuid4().hex
            self._record_run(PENDING + token)
            run_id = client.create_run(exp_id, run_name=self.cfg.run_name or None, tags={TOKEN_TAG: token}).info.run_id
            self._record_run(run_id)
        self._client, self.run_id = client, run_id
        if self.cfg.system_metrics:
            self._start_system_metrics()
        return run_id

    # The run this output folder's job opened: a group restarted by the launcher or torchrun (a
    # new process, no run id in its settings) logs into it instead of opening a second run. A
    # new job in the same folder (incarnation 0) opens its own and records that one.
    def _run_file(self) -> str:
        return os.path.join(self._out, RUN_FILE)

    def _recorded_run(self, client) -> str:
        """The recorded run's id ("" when none): a run still being created when its recorder
        died is found by its token, or was never created."""
        try:
            with open(self._run_file()) as f:
                recorded = f.read().strip()
        except OSError:
            return ""
        if not recorded.startswith(PENDING):
            return recorded
        exp = client.get_experiment_by_name(self.cfg.experiment)
        query = f"tags.`{TOKEN_TAG}` = '{recorded[len(PENDING) :]}'"
        runs = client.search_runs([exp.experiment_id], filter_string=query, max_results=1) if exp else []
        return runs[0].info.run_id if runs else ""

    def _record_run(self, run_id: str) -> None:
        atomic_write_text(self._run_file(), run_id)  # creates the output folder too

    def _send_metrics(self, client, run_id: str, items: list) -> None:
        """Log the points of steps this run has no point of yet: one point per metric and step,
        across the resumes of a job (a redone step's point is the first attempt's)."""
        fresh = [m for m in items if m.step > self._logged.get(m.key, -1)]
        if fresh:
            client.log_batch(run_id, metrics=fresh)

    def _start_system_metrics(self, resume: bool = False) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(
                self.run_id,
                sampling_interval=SYSTEM_METRICS_INTERVAL_S,
                resume_logging=resume or bool(self.cfg.run_id or self._logged),
                tracking_uri=self.uri,
            )
            self._monitor.start()
        except Exception as e:  # e.g. psutil missing: the run goes on without system metrics
            log.warning("mlflow: no system metrics (%s: %s)", type(e).__name__, e)

    def _revive_monitor(self) -> None:
        """MLflow's system-metrics thread ends at its first failed call (a tracking outage) and
        never starts again: once the server answers and the run still runs, start another one,
        from the next step."""
        mon = self._monitor
        thread = getattr(mon, "_process", None)  # the monitor's sampling thread (MLflow's own name)
        if mon is None or self._client is None or self.run_id is None or thread is None or thread.is_alive():
            return
        try:
            if self._client.get_run(self.run_id).info.status != "RUNNING":
                return
        except Exception:  # still down: next time
            return
        log.warning("mlflow: system metrics stopped (tracking server unavailable); starting them again")
        self._start_system_metrics(resume=True)

    def _attempt(self, op: _Op) -> bool:
        try:
            for attempt in Retrying(
                stop=stop_after_attempt(RETRY_ATTEMPTS),
                reraise=True,
                retry=retry_if_exception(_transient),
                wait=wait_exponential(multiplier=0.2, max=2),
            ):
                with attempt:
                    op.fn(self._client, self.run_id or self._start_run())
            return True
        except Exception as e:  # never propagate: training must go on
            op.tries += 1
            msg = f"{op.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if getattr(e, "error_code", None) in PERMANENT:
                log.warning("mlflow refused %s; dropped", msg)
                self.errors.append(msg)
                self.dropped += 1
                return True
            if not self.errors or self.errors[-1] != msg:
                log.warning("mlflow unavailable (%s); keeping it buffered", msg)
            self.errors.append(msg)
            return False

    def _work(self) -> None:
        closing = False  # close() was called and its sentinel reached this thread
        while True:
            # Retry what is buffered first, in order, so metrics keep their order.
            while self._buffer:
                if not self._attempt(self._buffer[0]):
                    break
                self._buffer.pop(0)
            if closing and self._q.empty() and (not self._buffer or self._buffer[0].tries >= 2):
                return  # flushed, or gave up after one more round; close() reports the rest
            if not self._buffer and not closing and time.monotonic() >= self._next_check:
                self._next_check = time.monotonic() + MONITOR_CHECK_S
                self._revive_monitor()
            try:
                op = self._q.get(timeout=RETRY_PAUSE_S if self._buffer else MONITOR_CHECK_S)
            except queue.Empty:
                continue
            if op is None:
                closing = True
            elif self._buffer or not self._attempt(op):
                self._buffer.append(op)
