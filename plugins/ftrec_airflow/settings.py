"""Where the pipeline keeps its files and talks to MLflow: embedded defaults, env overrides.

The long form: docs/airflow.md, "plugins/ftrec_airflow/settings"."""

import hashlib
import json
import os
import re
from pathlib import Path


def _project_root() -> tuple[Path, bool]:
    """(root, is a checkout): the checkout this package runs from (`make run`, the tests),
    else the current directory, which then plays the project's part (./work, ../shared/data)
    for an installed ftrec; a deployment sets FTREC_WORK anyway."""
    here = Path(__file__).resolve().parents[2]  # <checkout>/plugins/ftrec_airflow/settings.py
    if (here / "pyproject.toml").is_file() and (here / "dags").is_dir():
        return here, True
    return Path.cwd(), False


PROJECT_ROOT, IN_CHECKOUT = _project_root()

DEFAULT_EXPERIMENT = "ftrec"
DEFAULT_MODEL_NAME = "ftrec"
DEFAULT_MLFLOW_UI = "http://127.0.0.1:5000"
MLFLOW_CONN_ID = "ftrec_mlflow"
MLFLOW_CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def work_root() -> Path:
    return Path(os.environ.get("FTREC_WORK") or PROJECT_ROOT / "work").resolve()


def shared_data() -> Path:
    return Path(os.environ.get("FTREC_SHARED_DATA") or PROJECT_ROOT.parent / "shared" / "data")


def data_roots() -> list[Path]:
    """The folders a data_source param or an asset event's path may name (real paths):
    FTREC_DATA_ROOTS (os.pathsep-separated), else the shared data and the work folder. Whoever
    may trigger a DAG or post an asset event must not make the worker read any file it can."""
    given = [r for r in os.environ.get("FTREC_DATA_ROOTS", "").split(os.pathsep) if r.strip()]
    roots = [Path(r).expanduser() for r in given] or [shared_data(), work_root()]
    return [Path(os.path.realpath(r)) for r in roots]


def default_source() -> str:
    """The shared Beauty file when it is there, otherwise generated data."""
    beauty = shared_data() / "beauty.txt"
    return str(beauty) if beauty.exists() else "synthetic"


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, else the embedded SQLite store. Safe at parse time (no Airflow
    Connection lookup); tasks use `mlflow_connection`."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{work_root() / 'mlflow' / 'mlflow.db'}"


def _mlflow_conn():
    """The Airflow Connection `ftrec_mlflow`, or None where there is none."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return BaseHook.get_connection(MLFLOW_CONN_ID)
    except AirflowNotFoundException:
        return None


def mlflow_connection() -> tuple[str, dict[str, str]]:
    """(tracking URI, credential env vars) for a task: the Airflow Connection `ftrec_mlflow`
    when it exists, else `tracking_uri()` with whatever MLFLOW_TRACKING_* credentials the
    environment has.

    The connection: `extra.tracking_uri`, or schema (http/https, default http), host and
    port; login/password are basic auth, `extra.token` (or a password without login) a
    bearer token. Looking it up may ask the metadata DB or a secrets backend: call this
    inside a running task only, never while a DAG file is parsed."""
    conn = _mlflow_conn()
    if conn is None:
        return tracking_uri(), {k: os.environ[k] for k in MLFLOW_CREDENTIALS if os.environ.get(k)}
    extra = conn.extra_dejson
    uri = extra.get("tracking_uri")
    if not uri:
        if not conn.host:
            raise ValueError(f"Airflow connection {MLFLOW_CONN_ID}: set host (and port, schema) or extra.tracking_uri")
        host = conn.host.rstrip("/")
        if "://" not in host:
            host = f"{conn.schema or 'http'}://{host}"
        uri = f"{host}:{conn.port}" if conn.port else host
    creds: dict[str, str] = {}
    if conn.login:
        creds |= {"MLFLOW_TRACKING_USERNAME": conn.login, "MLFLOW_TRACKING_PASSWORD": conn.password or ""}
    token = extra.get("token") or (conn.password if not conn.login else None)
    if token:
        creds["MLFLOW_TRACKING_TOKEN"] = token
    return uri, creds


def train_task_args() -> dict:
    """Operator arguments of the train task: where it runs. Read while the DAG file is parsed
    (Airflow fixes queue and pool then), so only from the environment (FTREC_TRAIN_QUEUE,
    FTREC_TRAIN_POOL, FTREC_TRAIN_PRIORITY_WEIGHT, FTREC_TRAIN_EXECUTOR_CONFIG as JSON) or
    airflow.cfg's [ftrec] section (train_queue, ...): never Variables, which cost a
    metadata DB query on every parse. Unset keys are left out: the operator defaults apply."""
    from airflow.configuration import conf

    def get(key: str) -> str:
        return (
            os.environ.get(f"FTREC_TRAIN_{key.upper()}") or conf.get("ftrec", f"train_{key}", fallback="") or ""
        ).strip()

    args: dict = {k: get(k) for k in ("queue", "pool") if get(k)}
    try:
        if get("priority_weight"):
            args["priority_weight"] = int(get("priority_weight"))
        if get("executor_config"):
            args["executor_config"] = json.loads(get("executor_config"))
            if not isinstance(args["executor_config"], dict):
                raise ValueError(f"got {get('executor_config')!r}")
    except ValueError as e:  # shown as the DAG file's import error
        raise ValueError(
            f"FTREC_TRAIN_* / [ftrec] train_*: priority_weight must be an integer and "
            f"executor_config a JSON object ({e})"
        ) from None
    return args


def artifact_root(uri: str | None = None) -> str | None:
    """Artifact location for experiments we create: beside a local SQLite store; None lets
    a tracking server decide (its --default-artifact-root or proxied artifacts)."""
    uri = uri or tracking_uri()
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri[len("sqlite:///") :]).parent / "artifacts").resolve().as_uri()


def mlflow_ui() -> str:
    """The MLflow UI's base URL for links, at task run time: FTREC_MLFLOW_UI; else the
    `ftrec_mlflow` connection's extra.ui_url; else the tracking server the task logs to (an
    MLflow server serves its UI where it tracks); else, for a store that is a file, the
    `mlflow ui` that `make run` prints (DEFAULT_MLFLOW_UI)."""
    if os.environ.get("FTREC_MLFLOW_UI"):
        return os.environ["FTREC_MLFLOW_UI"].rstrip("/")
    try:
        conn = _mlflow_conn()
        uri = (conn.extra_dejson.get("ui_url") if conn else None) or mlflow_connection()[0]
    except Exception:  # outside a task (no Airflow to ask): the environment's store
        uri = tracking_uri()
    return uri.rstrip("/") if uri.startswith(("http://", "https://")) else DEFAULT_MLFLOW_UI


def lighthouse_url() -> str:
    return os.environ.get("FTREC_LIGHTHOUSE_URL", "").rstrip("/")


JOB_ID_MAX = 128  # ftcore's JOB_ID syntax: [A-Za-z0-9][A-Za-z0-9._:/+@=-]{0,127}


def lighthouse_job_id(run_key: str) -> str:
    """The job id one training run reports under on a standing lighthouse (ftcore's JOB_ID
    syntax): the run key `dag/run/task` itself when it fits; otherwise its legal characters,
    cut, then `=` and a hash of the whole key. A plain id never holds `=` (a key with one is
    hashed), so two run keys never share a job id."""
    job = re.sub(r"[^A-Za-z0-9._:/+@-]+", "-", run_key).lstrip("._:/+@-")
    if job == run_key and len(job) <= JOB_ID_MAX:
        return job
    digest = hashlib.sha256(run_key.encode()).hexdigest()[:32]
    return f"{job[: JOB_ID_MAX - len(digest) - 1] or 'run'}={digest}"


_KEEP = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")
NAME_MAX = 200  # a folder name's bytes; file systems allow 255


def slug(text: str) -> str:
    """`text` (a DAG or run id: user input) as one safe, reversible folder name (`unslug`):
    letters, digits and '-' stay, every other byte is `_XX` (hex), so `x`, `_x`, `x_` and
    `.x` differ, and no name is `.`, `..` or empty. A name longer than NAME_MAX keeps its
    start and ends in `__` + SHA-256 of `text` (no encoding contains `__`)."""
    name = "".join(chr(b) if chr(b) in _KEEP else f"_{b:02x}" for b in text.encode()) or "_"
    if len(name) <= NAME_MAX:
        return name
    return f"{name[: NAME_MAX - 66]}__{hashlib.sha256(text.encode()).hexdigest()}"


def unslug(name: str) -> str | None:
    """The text `slug` encoded as `name`; None for a hashed (long) name or a foreign one."""
    if name == "_":
        return ""
    if "__" in name:
        return None
    out, i = bytearray(), 0
    try:
        while i < len(name):
            if name[i] == "_":
                out.append(int(name[i + 1 : i + 3], 16))
                i += 3
            else:
                out += name[i].encode("ascii")
                i += 1
        return out.decode()
    except (ValueError, UnicodeError):
        return None


def run_folder(dag_id: str, run_id: str) -> Path:
    """The folder of one DAG run: every task of the run writes under it, so a retry
    finds what the first try left, and two DAG runs (of any two dag ids) never share one."""
    return work_root() / "runs" / slug(dag_id) / slug(run_id)
