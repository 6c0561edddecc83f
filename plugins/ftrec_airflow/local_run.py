"""`make run`: run a DAG end to end through Airflow on embedded defaults, then say where
everything is.

The long form: docs/airflow.md, "plugins/ftrec_airflow/local_run"."""

import argparse
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from ftcore.util.files import atomic_write_json, atomic_write_text
from ftrec_airflow import runner, settings
from ftrec_airflow.pipeline_ops import UserError
from ftrec_airflow.run_params import RunParams
from training import checkpoint_key, config  # the trainer's settings, the one --set parser, the key (no torch)

SUMMARY = "last_run.json"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # terminal colours: not part of a log line


def airflow_env(work: Path) -> dict[str, str]:
    """The environment that points Airflow, MLflow and the DAGs at `work`, and the checkpoint
    key (FTREC_CHECKPOINT_KEY_FILE) at WORK/checkpoint.key, made on first use, unless set."""
    root = settings.PROJECT_ROOT
    home = work / "airflow"
    env = {
        "FTREC_WORK": str(work),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(root / "dags"),
        # the checkout's plugins/ (Airflow's convention; its ftrec_plugin.py defers to the installed
        # package's entry point: one registration); an installed ftrec has none: an empty folder
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(root / "plugins" if settings.IN_CHECKOUT else home / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        # the UI's scheduler must not start ftrec_retrain's daily run by itself; unpause it there
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": "8080",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": "http://127.0.0.1:8080/execution/",
        # `airflow standalone`'s LocalExecutor starts this many worker processes: one per core,
        # not Airflow's default 32 (idle processes that a 2-core machine pays for in memory)
        "AIRFLOW__CORE__PARALLELISM": os.environ.get("AIRFLOW__CORE__PARALLELISM") or str(max(2, os.cpu_count() or 2)),
    }
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow' / 'mlflow.db'}"
    if not os.environ.get(checkpoint_key.KEY_ENV, "").strip():  # the work folder's own key, made once
        env[checkpoint_key.KEY_ENV] = str(checkpoint_key.ensure_key_file(work / checkpoint_key.KEY_NAME))
    return env


def write_env_file(work: Path, env: dict[str, str]) -> Path:
    path = work / "env.sh"
    text = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))
    # `airflow standalone` starts its components as plain `airflow` commands: the venv must be on PATH
    text += f'export PATH={shlex.quote(str(Path(sys.executable).parent))}:"$PATH"\n'
    atomic_write_text(path, "# source this file to point airflow and mlflow at the work folder\n" + text)
    return path


PARAMS = "params"  # --set params.KEY=VALUE: the DAG param KEY


def run_conf(conf: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """The DAG run's conf: `conf` (--conf), then the `--set section.key=value` items:
    `params.KEY` sets the DAG param KEY, a trainer setting (`train.epochs=3`) is appended to
    the train_overrides param. ConfigError names a bad item."""
    out = dict(conf)
    trainer = []
    for item in sets:
        key, sep, _ = item.partition("=")
        if sep and key.strip() and "." not in key:  # the param alone, as --set took it before
            raise config.ConfigError(f"--set {item!r}: a DAG param is params.KEY=VALUE: --set params.{item.strip()}")
        ((section, table),) = config.parse_overrides([item]).items()
        if section == PARAMS:
            unknown = sorted(set(table) - {f.name for f in dataclasses.fields(RunParams)})
            if unknown:
                raise config.ConfigError(
                    f"--set {item!r}: no DAG param {unknown[0]!r}; the params are RunParams' fields "
                    "(ftrec_airflow/run_params.py)"
                )
            out.update(table)
        elif section in {f.name for f in dataclasses.fields(config.Config)}:
            trainer.append(item)
        else:
            raise config.ConfigError(
                f"--set {item!r}: unknown section {section!r}: use params.<DAG param> (e.g. params.max_steps=50) "
                f"or a trainer setting (python -m training config --show)"
            )
    try:
        RunParams.of(out)  # a value of the wrong type fails now, not in the task that reads it
    except UserError as e:
        raise config.ConfigError(f"--set/--conf: {e}") from None
    if trainer:
        config.apply_overrides(config.Config(), trainer)  # a wrong name or type fails now, not in the train task
        out["train_overrides"] = [*(out.get("train_overrides") or []), *trainer]
    return out


def task_log_path(logs: Path, dag_id: str, run_id: str, task_id: str, try_number: int, map_index: int = -1) -> Path:
    """Where Airflow's UI looks for a task's log: [logging] log_filename_template's default."""
    mapped = f"map_index={map_index}/" if map_index >= 0 else ""
    return logs / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}" / f"{mapped}attempt={try_number}.log"


class TaskLog:
    """While one task runs inside dag.test(), everything this process writes to stdout and
    stderr (Airflow's task logger, the operators' loggers, the training's streamed output)
    still reaches the console and is also written to the task's log file, one JSON line
    {"timestamp", "event"} per line, the format Airflow's log reader parses: the UI's Logs
    tab shows it. dag.test() runs tasks in this process, so nothing else writes that file."""

    def __init__(self, path: Path):
        self.path = path
        self.pumps: list[threading.Thread] = []
        self.saved: list[int] = []

    def __enter__(self) -> "TaskLog":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.out = open(self.path, "ab", buffering=0)  # noqa: SIM115 - closed in __exit__
        self.lock = threading.Lock()
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            r, w = os.pipe()
            self.saved.append(os.dup(fd))
            os.dup2(w, fd)
            os.close(w)
            t = threading.Thread(target=self._pump, args=(r, self.saved[-1]), daemon=True)
            t.start()
            self.pumps.append(t)
        return self

    def _pump(self, r: int, console: int) -> None:
        rest = b""
        with os.fdopen(r, "rb", buffering=0) as src:
            while chunk := src.read(65536):
                os.write(console, chunk)
                *lines, rest = (rest + chunk).split(b"\n")
                self._write(lines)
        self._write([rest] if rest else [])

    def _write(self, lines: list[bytes]) -> None:
        from datetime import UTC, datetime

        now = datetime.now(UTC).isoformat()
        text = "".join(
            json.dumps({"timestamp": now, "event": ANSI.sub("", ln.decode(errors="replace")).rstrip()}) + "\n"
            for ln in lines
        )
        with self.lock:
            if not self.out.closed:
                self.out.write(text.encode())

    def __exit__(self, *exc) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved, strict=True):
            os.dup2(saved, fd)  # the pipe's last writer closes: its pump reads to the end
        for t in self.pumps:
            t.join(timeout=10)  # a child still holding the pipe must not hang the run
        for saved in self.saved:
            os.close(saved)
        with self.lock:
            self.out.close()


def _log_every_task(logs: Path) -> None:
    """Wrap dag.test()'s in-process task runner so each task writes its log (TaskLog)."""
    from airflow.sdk.execution_time import supervisor

    run = supervisor.run_task_in_process

    def with_log(ti, task, client=None):
        with TaskLog(task_log_path(logs, ti.dag_id, ti.run_id, ti.task_id, ti.try_number, ti.map_index)):
            return run(ti, task, client=client)

    supervisor.run_task_in_process = with_log


def unpause_unscheduled(bag) -> list[str]:
    """Unpause the DAGs without a schedule (they run only when triggered), so that a run
    triggered later from the UI starts instead of waiting, paused, without a word; a DAG with
    a schedule (ftrec_retrain's daily run) stays paused (DAGS_ARE_PAUSED_AT_CREATION).
    dag.test() has written every DAG of the folder to the metadata DB."""
    from airflow.models.dag import DagModel
    from airflow.sdk.definitions.timetables.simple import NullTimetable
    from airflow.utils.session import create_session
    from sqlalchemy import select

    ids = sorted(d for d, dag in bag.dags.items() if isinstance(dag.timetable, NullTimetable))
    with create_session() as session:
        for dm in session.scalars(select(DagModel).where(DagModel.dag_id.in_(ids))):
            dm.is_paused = False
    print(f"unpaused (no schedule: they run when triggered): {', '.join(ids)}", flush=True)
    return ids


def child(dag_id: str, conf: dict, summary_path: Path, logical_date: str | None = None) -> int:
    """Inside the configured environment: dag.test() the DAG and write a summary."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils import db

    print(f"airflow db migrate ({os.environ['AIRFLOW__DATABASE__SQL_ALCHEMY_CONN']})", flush=True)
    db.upgradedb()  # what `airflow db migrate` does, without starting another interpreter
    bag = DagBag(dag_folder=os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    if bag.import_errors:
        for f, err in bag.import_errors.items():
            print(f"error: {f}: {err}", file=sys.stderr)
        return 2
    if dag_id not in bag.dags:
        print(f"error: no DAG {dag_id!r} in {os.environ['AIRFLOW__CORE__DAGS_FOLDER']}", file=sys.stderr)
        return 2
    unknown = sorted(set(conf) - set(bag.dags[dag_id].params))
    if unknown:  # the DAG would ignore them
        print(
            f"error: {dag_id} has no param {', '.join(unknown)} (--conf, --set params.KEY=VALUE); "
            f"its params: {', '.join(bag.dags[dag_id].params)}",
            file=sys.stderr,
        )
        return 2
    when: dict[str, Any] = {}  # unset: dag.test's own defaults (logical_date NOTSET is not None)
    if logical_date:  # the same date again re-runs the same DAG run: every task a retry
        from datetime import datetime

        when["logical_date"] = when["run_after"] = datetime.fromisoformat(logical_date)
    _log_every_task(Path(os.environ["AIRFLOW_HOME"]) / "logs")
    dr = bag.dags[dag_id].test(run_conf=conf, **when)
    unpaused = unpause_unscheduled(bag)
    # a mapped task's instances by "task_id[map_index]"; a task group's by "group.task"
    tis = {ti.task_id + (f"[{ti.map_index}]" if ti.map_index >= 0 else ""): ti for ti in dr.get_task_instances()}
    xcoms = {tid: ti.xcom_pull(task_ids=ti.task_id, map_indexes=ti.map_index) for tid, ti in tis.items()}
    links = {
        tid: {key: ti.xcom_pull(task_ids=tid, key=f"_link_{key}") for key in ("MLflowRunLink", "LighthouseLink")}
        for tid, ti in tis.items()
        if tid == "train"
    }
    summary = {
        "dag_id": dag_id,
        "run_id": dr.run_id,
        "state": str(dr.state),
        "tasks": {tid: str(ti.state) for tid, ti in tis.items()},
        "run_folder": str(settings.run_folder(dag_id, dr.run_id)),
        "xcom": {k: v for k, v in xcoms.items() if isinstance(v, (dict, list, str, int, float))},
        "links": links,
        "unpaused": unpaused,
    }
    atomic_write_json(summary_path, summary, indent=1, default=str)
    return 0 if summary["state"].endswith("success") else 1


def report(summary: dict, work: Path, env_file: Path) -> str:
    lines = [f"DAG {summary['dag_id']} run {summary['run_id']}: {summary['state']}"]
    lines += [f"  {tid:16s} {state}" for tid, state in summary["tasks"].items()]
    ev = summary["xcom"].get("evaluate") or {}
    metrics = ev.get("metrics", {})
    if metrics:
        lines.append("test metrics:")
        lines += [f"  {k:24s} {v:.4f}" for k, v in sorted(metrics.items()) if k.startswith("test/")]
    reg = summary["xcom"].get("register_model")
    if isinstance(reg, dict):
        lines.append(f"registered model: {reg.get('name')} version {reg.get('version')}")
    tr = summary["xcom"].get("train") or {}
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{work / 'mlflow' / 'mlflow.db'}"
    lines += [
        f"run folder:     {summary['run_folder']}",
        f"MLflow store:   {uri}" + (f"  (run {tr['mlflow_run_id']})" if tr.get("mlflow_run_id") else ""),
        f"Airflow home:   {work / 'airflow'}  (metadata: {work / 'airflow' / 'airflow.db'})",
        "open the UIs on 127.0.0.1:",
        f"  MLflow:  .venv/bin/mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000",
        f"  Airflow: {sys.executable} -m ftrec_airflow.ui --work {work}   # http://127.0.0.1:8080, "
        f"password in {work / 'airflow' / 'simple_auth_manager_passwords.json.generated'}",
        f"  (or . {env_file} && airflow standalone, whose log servers listen on every interface)",
    ]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ftrec_airflow.local_run", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    p.add_argument("--work", default=str(settings.work_root()), help="work folder (default: <project>/work)")
    p.add_argument("--dag", default="ftrec_train")
    p.add_argument("--conf", default="{}", help="DAG run conf as JSON")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="params.KEY=VALUE: a DAG param (params.max_steps=50); a trainer setting "
        "(train.epochs=3, model.dim=32) joins train_overrides. The value in TOML syntax, "
        "bare text is a string",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=float(os.environ.get("FTREC_RUN_TIMEOUT_S", 7200)),
        help="give up on the DAG run after this many seconds (default 7200)",
    )
    p.add_argument("--logical-date", help="ISO date of the DAG run; the same date again re-runs that run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def _conf(a: argparse.Namespace) -> dict[str, Any] | str:
    """The DAG run's conf from --conf and --set, or the error to print."""
    try:
        conf = json.loads(a.conf)
    except ValueError as e:
        return f"--conf is not JSON ({e})"
    if not isinstance(conf, dict):
        return f"--conf must be a JSON object, got {a.conf!r}"
    try:
        conf = run_conf(conf, a.set)
    except config.ConfigError as e:
        return str(e)
    if conf.get("champion_approval"):  # dag.test has no scheduler to hand a person's answer back
        return (
            "params.champion_approval: a person's approval needs Airflow's scheduler and UI; this runner "
            "(dag.test) cannot wait for one. Trigger the DAG under `airflow standalone` or your deployment"
        )
    return conf


def _run_child(a: argparse.Namespace, conf: dict[str, Any], work: Path) -> int | None:
    """Run this module with --child in the Airflow environment, in its own process group
    (a timeout or Ctrl-C ends all it started); its exit code, or None when it was stopped
    (the message printed; main returns 130 or 1)."""
    env = {**os.environ, **airflow_env(work)}
    cmd = [sys.executable, "-m", "ftrec_airflow.local_run", "--child", "--work", str(work), "--dag", a.dag]
    cmd += ["--conf", json.dumps(conf), *(["--logical-date", a.logical_date] if a.logical_date else [])]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    # SIGTERM (a supervisor, `timeout`, `kill`) stops the run as Ctrl-C does: the child's process
    # group ends with it (its own session leaves it out of the signal, and Python's default
    # SIGTERM would end this process at once, without the finally below)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return proc.wait(timeout=a.timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
        runner.stop_group(proc)
        if isinstance(e, KeyboardInterrupt):
            raise
        print(f"error: the DAG run took longer than --timeout {a.timeout:.0f} s; stopped it", file=sys.stderr)
        return None
    finally:
        runner.stop_group(proc)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    conf = _conf(a)
    if isinstance(conf, str):
        print(f"error: {conf}", file=sys.stderr)
        return 2
    work = Path(a.work).resolve()
    summary_path = work / SUMMARY
    if a.child:
        return child(a.dag, conf, summary_path, a.logical_date)

    work.mkdir(parents=True, exist_ok=True)
    (work / "airflow").mkdir(exist_ok=True)
    env_file = write_env_file(work, airflow_env(work))
    summary_path.unlink(missing_ok=True)
    try:
        rc = _run_child(a, conf, work)
    except KeyboardInterrupt:
        return 130
    if rc is None:
        return 1
    if not summary_path.exists():
        print(f"error: the DAG run did not complete (exit code {rc}); see the output above", file=sys.stderr)
        return rc or 1
    summary = json.loads(summary_path.read_text())
    print("\n" + report(summary, work, env_file))
    return rc


if __name__ == "__main__":
    sys.exit(main())
