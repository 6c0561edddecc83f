"""The ftcore lighthouse seen from Airflow: where a training's lighthouse is, its status while
training runs, and the last snapshot kept in the run folder afterwards.

The long form: docs/airflow.md, "plugins/ftrec_airflow/lighthouse_status"."""

import json
import os
import re
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, BinaryIO

from ftrec_airflow import settings

SNAPSHOT = "lighthouse.json"
POLL_S = float(os.environ.get("FTREC_LIGHTHOUSE_POLL_S", "2"))
FETCH_TIMEOUT_S = 2.0
# "lighthouse ... 127.0.0.1:PORT" or "lighthouse ... http://host:port" in the launcher's output
_ADDR = re.compile(
    r"lighthouse\b.*?\b((?:https?://)?(?:\d{1,3}(?:\.\d{1,3}){3}|localhost|\[[0-9a-f:]+\]):\d{2,5})", re.IGNORECASE
)


def address_in(line: str) -> str | None:
    """The lighthouse URL a launcher's log line announces, if it announces one."""
    m = _ADDR.search(line)
    if not m:
        return None
    addr = m.group(1)
    return addr if addr.startswith("http") else f"http://{addr}"


TOKEN_MAX = 4096
_TOKEN = re.compile(r"[\x21-\x7e]+")  # one line of visible ASCII: what a Bearer header may carry


def _one_token(text: str, where: str) -> str | None:
    """`text` stripped if it is one token; ValueError naming `where` (never the text) if not."""
    token = text.strip()
    if not token:
        return None
    if len(token) > TOKEN_MAX or not _TOKEN.fullmatch(token):
        raise ValueError(f"{where} does not hold one token (one line of visible ASCII); its content is not shown")
    return token


def server_token() -> str | None:
    """This process's own lighthouse token: FTCORE_TOKEN, else the file FTCORE_TOKEN_FILE
    names (configuration: a Kubernetes secret mount's symlinks are fine). ValueError when it
    is not one token; the message never holds its content."""
    if os.environ.get("FTCORE_TOKEN"):
        return _one_token(os.environ["FTCORE_TOKEN"], "FTCORE_TOKEN")
    path = os.environ.get("FTCORE_TOKEN_FILE")
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(TOKEN_MAX + 1)
    except OSError as e:
        raise ValueError(f"FTCORE_TOKEN_FILE {path} is unreadable ({e.strerror})") from None
    return _one_token(raw.decode("ascii", "replace"), f"FTCORE_TOKEN_FILE {path}")


def open_nofollow(path: Path, root: Path) -> BinaryIO | None:
    """The regular file `path` under `root` opened for reading, following no symlink on the
    way: every folder below `root` is lstat'ed, the file opened with O_NOFOLLOW. None when it
    is absent, a link or not a regular file."""
    try:
        rel = Path(path).relative_to(root)
    except ValueError:
        return None
    cur = Path(root)
    try:
        for part in rel.parts[:-1]:
            cur = cur / part
            if not stat.S_ISDIR(os.lstat(cur).st_mode):  # a symlink is not S_ISDIR under lstat
                return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        return None
    return f


def read_nofollow(path: Path, root: Path, limit: int = 1 << 20) -> bytes | None:
    """The bytes of the regular file `path` under `root` (`open_nofollow`); None when it is
    absent, a link, not a regular file or larger than `limit`."""
    f = open_nofollow(path, root)
    if f is None:
        return None
    with f:
        if os.fstat(f.fileno()).st_size > limit:
            return None
        return f.read(limit + 1)[:limit]


def _token(token_file: str | Path | None = None) -> str | None:
    """The train task's token for its own launcher's lighthouse (`token_file`, the launcher's
    output), else this process's (server_token)."""
    if token_file and Path(token_file).is_file() and not Path(token_file).is_symlink():
        return _one_token(Path(token_file).read_text(errors="replace"), f"token file {token_file}")
    return server_token()


def job_token(token: str, job: str) -> str:
    """`job`'s credential derived from `token` (ftcore.auth.job_token; a job token that is
    already `job`'s passes as it is); ValueError when `token` is another job's."""
    from ftcore import auth  # here: DAG parsing needs none of it

    return auth.job_token(token, job)


def _reason(e: Exception) -> str:
    """Why a fetch failed, in words of our own: never the body or a header it was handed."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code}"
    if isinstance(e, urllib.error.URLError):
        return e.reason.strerror if isinstance(e.reason, OSError) and e.reason.strerror else "unreachable"
    if isinstance(e, TimeoutError):
        return "timed out"
    if isinstance(e, OSError):
        return e.strerror or type(e).__name__
    return "its answer is not a status document"


def fetch_status(
    url: str,
    timeout: float = FETCH_TIMEOUT_S,
    token_file: str | Path | None = None,
    job: str | None = None,
    token: str | None = None,
) -> dict[str, Any]:
    """GET <url>/status (of `job` on a standing lighthouse) with `token` (default: `_token`),
    made `job`'s own token when a job is named (the admin secret would list every job);
    raises OSError, or ValueError for an answer that is no JSON object or a token of another
    job, with a message of our own (`_reason`)."""
    query = "?" + urllib.parse.urlencode({"job": job}) if job else ""
    req = urllib.request.Request(url.rstrip("/") + "/status" + query)
    token = token if token is not None else _token(token_file)
    if token and job:
        token = job_token(token, job)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            doc = json.loads(resp.read(1 << 22).decode())
    except (OSError, ValueError) as e:
        raise (ValueError if isinstance(e, ValueError) else OSError)(_reason(e)) from None
    if not isinstance(doc, dict):
        raise ValueError(_reason(ValueError()))
    return doc


def write_snapshot(run_dir: Path, url: str, status: dict | None, error: str = "", job: str | None = None) -> None:
    """No token and no token path in it: the page finds tokens where only ftrec puts them."""
    path = Path(run_dir) / SNAPSHOT
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"url": url, "fetched_at": time.time(), "status": status, "error": error, "job": job}
    if status is None and path.exists():  # keep the last good status, note the error
        try:
            old = json.loads(path.read_text())
            doc["status"], doc["fetched_at"] = old.get("status"), old.get("fetched_at")
        except ValueError:
            pass
    from ftcore.util.files import atomic_write_json  # here: DAG parsing needs none of it

    atomic_write_json(path, doc)


def read_snapshot(run_dir: Path, root: Path | None = None) -> dict | None:
    """The run's last snapshot, read without following a symlink below `root` (default: the
    work folder); None when absent, a link or not a JSON object."""
    raw = read_nofollow(Path(run_dir) / SNAPSHOT, root or settings.work_root())
    try:
        doc = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class Watcher:
    """Polls the lighthouse in a daemon thread while training runs; `see(line)` takes the
    launcher's output lines and picks up the lighthouse's address from them."""

    def __init__(self, run_dir: Path, url: str = "", token_file: str | Path | None = None, job: str | None = None):
        self.run_dir = Path(run_dir)
        self.token_file = token_file
        self.job = job
        self.url = url or settings.lighthouse_url()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ftrec-lighthouse-watch", daemon=True)

    def see(self, line: str) -> None:
        if not self.url:
            self.url = address_in(line) or ""

    def _poll(self) -> None:
        if not self.url:
            return
        try:
            status = fetch_status(self.url, token_file=self.token_file, job=self.job)
            write_snapshot(self.run_dir, self.url, status, job=self.job)
        except (OSError, ValueError) as e:
            write_snapshot(self.run_dir, self.url, None, error=str(e), job=self.job)

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            self._poll()

    def __enter__(self) -> "Watcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=FETCH_TIMEOUT_S + 1)
        self._poll()  # one last look: the final quorum and events, if it still answers
