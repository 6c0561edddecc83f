"""The ftcore lighthouse seen from Airflow: where a training's lighthouse is, its status
while training runs, and the last snapshot kept in the run folder afterwards.

The train task watches the lighthouse the launcher started (its address appears in the
launcher's output, or FTREC_LIGHTHOUSE_URL names a standing one) and writes each status
it reads to `<run folder>/lighthouse.json` by atomic rename. The plugin's status page reads
that file, and the lighthouse itself when it still answers, so the page works after the
training ended and when the API server cannot reach the training's machine.
"""

import json
import os
import re
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

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


def _token(token_file: str | Path | None = None) -> str | None:
    if token_file and Path(token_file).is_file():
        return Path(token_file).read_text().strip() or None
    if os.environ.get("FTCORE_TOKEN"):
        return os.environ["FTCORE_TOKEN"]
    path = os.environ.get("FTCORE_TOKEN_FILE")
    if path and Path(path).is_file():
        return Path(path).read_text().strip() or None
    return None


def fetch_status(
    url: str, timeout: float = FETCH_TIMEOUT_S, token_file: str | Path | None = None, job: str | None = None
) -> dict[str, Any]:
    """GET <url>/status (of `job` on a standing lighthouse) with the shared token; raises
    OSError when it does not answer."""
    query = "?" + urllib.parse.urlencode({"job": job}) if job else ""
    req = urllib.request.Request(url.rstrip("/") + "/status" + query)
    token = _token(token_file)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


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
    from dataprep.fsutil import atomic_write_json  # here: DAG parsing imports this module, not dataprep

    atomic_write_json(path, doc)


def read_snapshot(run_dir: Path) -> dict | None:
    path = Path(run_dir) / SNAPSHOT
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


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
