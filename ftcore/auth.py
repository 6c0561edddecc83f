"""The shared token that every ftcore HTTP request carries (lighthouse and heal servers).

The token travels in the `Authorization: Bearer <token>` header only (never in a URL).
Servers compare it in constant time and refuse anything else with 401. Processes find the token in
FTCORE_TOKEN, or in the file named by FTCORE_TOKEN_FILE.
"""

import hmac
import os
import secrets
import sys

from ftcore.fsutil import atomic_writer

HEADER = "Authorization"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token_file(path: str) -> str:
    """A new token in a new file at `path`, readable by its owner only from the first byte."""
    token = new_token()
    with atomic_writer(path, perm=0o600) as f:
        f.write(token.encode())
    return token


def read_token_file(path: str) -> str:
    try:
        with open(path) as f:
            token = f.read().strip()
            mode = os.fstat(f.fileno()).st_mode
    except OSError as e:
        raise SystemExit(
            f"ftcore: cannot read token file {path}: {e.strerror}; create it or pass another --token-file"
        ) from None
    if not token:
        raise SystemExit(f"ftcore: token file {path} is empty; write a secret token into it")
    if mode & 0o077:
        print(
            f"ftcore: warning: token file {path} is readable by its group or others "
            f"(mode {mode & 0o777:o}); chmod 600 {path}",
            file=sys.stderr,
            flush=True,
        )
    return token


def token_from_env() -> str | None:
    """The token this process should send and require, or None when none is configured."""
    if os.environ.get("FTCORE_TOKEN"):
        return os.environ["FTCORE_TOKEN"]
    if os.environ.get("FTCORE_TOKEN_FILE"):
        return read_token_file(os.environ["FTCORE_TOKEN_FILE"])
    return None


def headers(token: str | None) -> dict[str, str]:
    return {HEADER: f"Bearer {token}"} if token else {}


def allowed(expected: str | None, header_value: str | None) -> bool:
    """True when no token is configured, or the request carries exactly that token."""
    if expected is None:
        return True
    if not header_value or not header_value.startswith("Bearer "):
        return False
    return hmac.compare_digest(header_value[len("Bearer ") :].encode(), expected.encode())
