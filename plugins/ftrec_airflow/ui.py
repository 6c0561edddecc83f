"""The Airflow UI of `make run`'s work folder, on 127.0.0.1 only: `airflow standalone`'s
components, started here.

    python -m ftrec_airflow.ui [--work work]

`airflow standalone` (Airflow 3.3) starts the scheduler and the triggerer with their log servers
(ports 8793 and 8794), which listen on every interface: Airflow fixes their address and no
setting moves it. Here the API server listens on 127.0.0.1 (AIRFLOW__API__HOST, local_run's
environment) and the scheduler and the triggerer run with --skip-serve-logs: on one machine
the API server reads the task logs from their files. Ctrl-C or SIGTERM stops every component,
each by its process group."""

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ftrec_airflow import local_run, runner, settings

# (airflow subcommand, its arguments): nothing listens beyond 127.0.0.1
COMPONENTS: tuple[tuple[str, list[str]], ...] = (
    ("api-server", []),
    ("scheduler", ["--skip-serve-logs"]),
    ("dag-processor", []),
    ("triggerer", ["--skip-serve-logs"]),
)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def serve(work: Path) -> int:
    """Run the components until one exits (1) or this process is stopped (130)."""
    env = {**os.environ, **local_run.airflow_env(work)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    airflow = str(Path(sys.executable).parent / "airflow")
    procs: dict[str, subprocess.Popen] = {}
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        subprocess.run([airflow, "db", "migrate"], env=env, check=True, timeout=600)
        for name, args in COMPONENTS:
            procs[name] = subprocess.Popen([airflow, name, *args], env=env, start_new_session=True)
        passwords = work / "airflow" / "simple_auth_manager_passwords.json.generated"
        print(f"Airflow UI: http://{env['AIRFLOW__API__HOST']}:{env['AIRFLOW__API__PORT']} (password in {passwords})")
        while all(p.poll() is None for p in procs.values()):
            time.sleep(1)
        dead = [f"{name} (exit {p.returncode})" for name, p in procs.items() if p.poll() is not None]
        print(f"error: airflow {', '.join(dead)} stopped; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except subprocess.SubprocessError as e:
        print(f"error: airflow db migrate: {e}", file=sys.stderr)
        return 1
    finally:
        for p in procs.values():
            runner.stop_group(p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftrec_airflow.ui", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--work", default=str(settings.work_root()), help="work folder of `make run` (default: <project>/work)"
    )
    return serve(Path(p.parse_args(argv).work).resolve())


if __name__ == "__main__":
    sys.exit(main())
