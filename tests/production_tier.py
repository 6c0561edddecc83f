"""The production tier's servers for tests: a throwaway PostgreSQL cluster and an MLflow tracking
server on it, both on 127.0.0.1, each started bounded and stopped by its PID.

PostgreSQL is Debian's (`postgresql`, /usr/lib/postgresql/<version>/bin): a fresh cluster in a
temporary folder of its own, owned by the `postgres` user when the tests run as root (the server
refuses to run as root), with a random password for TCP logins and its unix socket in the same
folder. `.ci/run` installs the package where `initdb` is missing; without it the tests skip."""

import glob
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PG_USER = "ftrec"


def pg_bin() -> Path | None:
    """The folder of Debian's newest PostgreSQL binaries (initdb, postgres), or one on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def pg_unavailable() -> str | None:
    """Why a PostgreSQL cluster cannot be made here, or None."""
    if pg_bin() is None:
        return "PostgreSQL is not installed (Debian's `postgresql`: initdb, postgres); .ci/run installs it"
    if os.geteuid() == 0:
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run the server as"
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        return "psycopg2 is not installed (the `test` extra: pip install -e '.[test]')"
    return None


class Postgres:
    """A PostgreSQL server on 127.0.0.1:`port` with `databases`, owned by PG_USER; `close()`
    stops it (SIGINT: a fast shutdown, then SIGKILL) and removes its folder."""

    def __init__(self, port: int, databases: list[str], timeout: float = 60):
        self.port, self.password = port, secrets.token_hex(16)
        self.dir = Path(tempfile.mkdtemp(prefix="ftrec-pg-"))  # not under pytest's root-only tmp_path
        self.proc: subprocess.Popen | None = None
        as_user: dict = {}
        if os.geteuid() == 0:
            as_user = {"user": "postgres", "group": "postgres", "extra_groups": []}
            shutil.chown(self.dir, "postgres", "postgres")
        try:
            self._start(as_user, timeout)
            self._create(databases)
        except BaseException:
            self.close()
            raise

    def _start(self, as_user: dict, timeout: float) -> None:
        bindir = pg_bin()
        assert bindir is not None
        pwfile = self.dir / "pw"
        pwfile.write_text(self.password)
        if as_user:
            shutil.chown(pwfile, "postgres", "postgres")
        data = self.dir / "data"
        subprocess.run(
            [bindir / "initdb", "-D", data, "-U", PG_USER, f"--pwfile={pwfile}", "--auth=scram-sha-256"]
            + ["-E", "UTF8", "--locale=C", "--no-sync"],
            check=True,
            capture_output=True,
            timeout=timeout,
            **as_user,
        )
        pwfile.unlink()
        self.log = open(self.dir / "postgres.log", "w")
        # fsync off: a throwaway cluster; the connection limit covers every Airflow and MLflow process.
        # A scheduler killed inside a transaction leaves its LocalExecutor workers (forked from it)
        # holding its connection open, and with it the DAG run's row lock: the next scheduler skips
        # the run (SKIP LOCKED) until the session ends. Production Airflow databases want this too.
        settings = ["fsync=off", "synchronous_commit=off", "full_page_writes=off", "max_connections=200"]
        settings += ["idle_in_transaction_session_timeout=10s"]
        self.proc = subprocess.Popen(
            [bindir / "postgres", "-D", data, "-h", "127.0.0.1", "-p", str(self.port), "-k", self.dir]
            + [a for s in settings for a in ("-c", s)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **as_user,
        )
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not start: {(self.dir / 'postgres.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def _connect(self, db: str = "postgres"):
        import psycopg2

        return psycopg2.connect(
            host="127.0.0.1", port=self.port, user=PG_USER, password=self.password, dbname=db, connect_timeout=5
        )

    def _ready(self) -> bool:
        try:
            self._connect().close()
            return True
        except Exception:  # noqa: BLE001 - not accepting connections yet
            return False

    def _create(self, databases: list[str]) -> None:
        conn = self._connect()
        conn.autocommit = True
        with conn.cursor() as cur:
            for db in databases:
                cur.execute(f'CREATE DATABASE "{db}"')
        conn.close()

    def url(self, db: str) -> str:
        return f"postgresql+psycopg2://{PG_USER}:{self.password}@127.0.0.1:{self.port}/{db}"

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown: ends every backend
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if getattr(self, "log", None) is not None:
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class MlflowServer:
    """`mlflow server` on 127.0.0.1:`port`: tracking and registry in `backend` (a database URL),
    artifacts proxied into `artifacts`; in a process group of its own, stopped by it."""

    def __init__(self, port: int, backend: str, artifacts: Path, log: Path):
        self.url = f"http://127.0.0.1:{port}"
        mlflow = str(Path(sys.executable).parent / "mlflow")
        argv = [mlflow, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        argv += ["--backend-store-uri", backend, "--artifacts-destination", str(artifacts)]
        self.log = open(log, "w")
        # its job runner would leave a store under /dev/shm that nothing removes
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def up(self) -> bool:
        """Whether it answers (raises when it exited)."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {self.proc.returncode}; its log: {self.log.name}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        else:  # its workers may outlive it in its group
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()
