"""Credentials of every ftcore HTTP request (lighthouse, relay, heal servers). The lighthouse
holds one admin secret; each job's token is the job id with an HMAC of it (`job_token`), so it
is checked from the header alone and survives a restart. A job token opens its own job's
routes and heal servers only. Tokens travel in `Authorization: Bearer` headers only,
compared in constant time; processes read FTCORE_TOKEN or FTCORE_TOKEN_FILE."""

import base64
import hashlib
import hmac
import secrets
import sys

from ftcore.environment import RankEnv
from ftcore.util.files import atomic_writer, read_secret

HEADER = "Authorization"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token_file(path: str, token: str | None = None) -> str:
    """`token` (by default a new one) in a new file at `path`, readable by its owner only from
    the first byte."""
    token = token or new_token()
    with atomic_writer(path, "wb", perm=0o600) as f:
        f.write(token.encode())
    return token


def read_token_file(path: str) -> str:
    try:
        token = read_secret(path, "ftcore: warning: token file")
    except OSError as e:
        raise SystemExit(
            f"ftcore: cannot read token file {path}: {e.strerror}; create it or pass another --token-file"
        ) from None
    if not token:
        raise SystemExit(f"ftcore: token file {path} is empty; write a secret token into it")
    return token


def token_from_env() -> str | None:
    """The token this process should send and require, or None when none is configured."""
    told = RankEnv.from_env()
    if told.token:
        return told.token
    if told.token_file:
        return read_token_file(told.token_file)
    return None


def headers(token: str | None) -> dict[str, str]:
    return {HEADER: f"Bearer {token}"} if token else {}


JOB_PREFIX = "ftjob1."


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def job_token(secret: str, job: str) -> str:
    """The credential of `job` under the lighthouse secret `secret` (idempotent: a job token
    given as `secret` is returned as it is, when it is that job's)."""
    if secret.startswith(JOB_PREFIX):
        if job_of(secret) != job:
            raise ValueError(f"the token given is job {job_of(secret)!r}'s, not job {job!r}'s; give that job's token")
        return secret
    mac = hmac.new(secret.encode(), b"ftcore-job\0" + job.encode(), hashlib.sha256).digest()
    return f"{JOB_PREFIX}{_b64(job.encode())}.{_b64(mac)}"


def job_of(token: str) -> str | None:
    """The job a job token names (not verified), or None when it is not a job token."""
    if not token.startswith(JOB_PREFIX):
        return None
    encoded, sep, _ = token[len(JOB_PREFIX) :].partition(".")
    if not sep or len(encoded) > 200:
        return None
    try:
        return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        return None


ADMIN = "*"  # the scope of the admin token: every job


def scope(secret: str | None, header_value: str | None) -> str | None:
    """Who the request's token speaks for: ADMIN (the secret itself, or no secret configured),
    a job id (that job's token), or None (no valid token: refuse it)."""
    if secret is None:
        return ADMIN
    if not header_value or not header_value.startswith("Bearer "):
        return None
    given = header_value[len("Bearer ") :]
    if hmac.compare_digest(given.encode(), secret.encode()):
        return ADMIN
    job = job_of(given)
    if job is None or not hmac.compare_digest(given.encode(), job_token(secret, job).encode()):
        return None
    return job


def allowed(expected: str | None, header_value: str | None) -> bool:
    """True when no token is configured, or the request carries exactly that token."""
    if expected is None:
        return True
    if not header_value or not header_value.startswith("Bearer "):
        return False
    return hmac.compare_digest(header_value[len("Bearer ") :].encode(), expected.encode())


def main(argv: list[str] | None = None) -> int:
    """`python -m ftcore.auth job-token JOB [--token-file F]`: print JOB's token (give it to
    that job's ranks instead of the admin secret)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m ftcore.auth", description=main.__doc__)
    p.add_argument("command", choices=["job-token"])
    p.add_argument("job", help="the job id (FTCORE_JOB_ID)")
    p.add_argument("--token-file", help="the lighthouse's admin secret (else FTCORE_TOKEN / FTCORE_TOKEN_FILE)")
    a = p.parse_args(argv)
    secret = read_token_file(a.token_file) if a.token_file else token_from_env()
    if secret is None:
        print("ftcore.auth: no secret; give --token-file or set FTCORE_TOKEN_FILE", file=sys.stderr)
        return 2
    from ftcore.messages import MessageError, job_id

    try:
        print(job_token(secret, job_id(a.job)))
    except (MessageError, ValueError) as e:
        print(f"ftcore.auth: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
