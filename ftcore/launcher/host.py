"""The job's lighthouse as the launcher sees it: one it hosts (and restarts) or a standing one."""

import os
import sys
import time
import urllib.parse
from collections.abc import Callable

from ftcore import auth
from ftcore.launcher.config import LaunchConfig, LaunchError
from ftcore.launcher.procs import Proc
from ftcore.lighthouse_client import call
from ftcore.util.procs import free_port


class LighthouseHost:
    """Our own lighthouse gets a fresh admin secret in OUT/token; a standing one is reached with
    the token we were given (its admin secret or this job's token). Ranks get only this job's
    token (OUT/job-token): it opens this job's routes and heal servers, nothing else. The files
    are written once the run folder's lease is held (write_tokens)."""

    def __init__(self, cfg: LaunchConfig, out: str, log: Callable[..., None]):
        self.cfg = cfg
        self.out = out
        self.proc: Proc | None = None
        self.token_file: str | None = None
        if cfg.lighthouse is None:
            self.token_file = os.path.join(out, "token")
            self.token: str | None = auth.new_token()
        else:
            self.token = auth.token_from_env()
            if self.token is None:
                log(
                    "warning",
                    message=f"no FTCORE_TOKEN_FILE or FTCORE_TOKEN for lighthouse {cfg.lighthouse}: "
                    "only a lighthouse started with --insecure will accept the ranks",
                )
        self.job_token_file: str | None = None
        self.job_token: str | None = None
        if self.token is not None:
            try:
                self.job_token = auth.job_token(self.token, cfg.job_id)
            except ValueError as e:
                raise LaunchError(f"FTCORE_TOKEN_FILE / FTCORE_TOKEN: {e}") from None
            self.job_token_file = os.path.join(out, "job-token")
        self.addr = cfg.lighthouse or f"127.0.0.1:{free_port()}"
        self.status_path = "/status?" + urllib.parse.urlencode({"job": cfg.job_id})

    def write_tokens(self) -> None:
        """OUT/token (our own lighthouse's) and OUT/job-token (the ranks'): written only by the
        launcher that holds the run folder's lease, never over a live job's."""
        if self.token_file is not None and self.token is not None:
            auth.write_token_file(self.token_file, self.token)
        if self.job_token_file is not None and self.job_token is not None:
            auth.write_token_file(self.job_token_file, self.job_token)

    def argv(self) -> list[str]:
        if self.token_file is None:
            raise LaunchError("the launcher starts a lighthouse only with a token file of its own (OUT/token)")
        return [
            sys.executable,
            "-m",
            "ftcore.launcher.child",
            "run",
            "ftcore.lighthouse",
            "--bind",
            self.addr,
            "--min-replicas",
            str(self.cfg.min_replicas),
            "--expected-replicas",
            str(self.cfg.replica_groups),
            "--token-file",
            self.token_file,
            "--events-file",
            os.path.join(self.out, "lighthouse-events.jsonl"),
        ]

    def wait_ready(self, proc: Proc, within_s: float = 30) -> None:
        """Until the lighthouse answers /status, or a LaunchError."""
        self.proc = proc
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if proc.p.poll() is not None:
                raise LaunchError(f"the lighthouse exited with status {proc.p.returncode} (is {self.addr} in use?)")
            try:
                if call(self.addr, self.status_path, None, self.token, method="GET", timeout=1)[0] == 200:
                    return
            except OSError:
                time.sleep(0.05)
        raise LaunchError(f"the lighthouse did not answer on {self.addr} within {within_s:.0f}s")

    def status(self) -> dict | None:
        try:
            code, body = call(self.addr, self.status_path, None, self.token, method="GET", timeout=1)
            return body if code == 200 else None
        except OSError:
            return None

    def died(self) -> bool:
        """Ours, dead, and not by the fault plan's hand."""
        return self.proc is not None and self.proc.p.poll() is not None and not self.proc.planned_kill
