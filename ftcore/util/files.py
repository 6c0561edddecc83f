"""Atomic file writes, file hashes, and secret files read with their mode checked.

A file written here appears complete or not at all: written to `.NAME.XXXXXXXX.tmp` in the
same folder (created with `perm` less the umask, so a private file is private from its first
byte), flushed and fsynced, then renamed over `path`; on failure the temporary file is
removed and `path` is left as it was."""

import contextlib
import hashlib
import json
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def _create_temp(path: Path, perm: int) -> tuple[int, Path]:
    """A new, empty file beside `path`, created with `perm` (O_EXCL: never someone else's)."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, perm), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


@contextlib.contextmanager
def atomic_writer(
    path: "str | os.PathLike", mode: str = "w", *, perm: int = 0o666, encoding: str | None = None
) -> Iterator[IO[Any]]:
    """`with atomic_writer(path, "wb") as f:` a file object to write `path`'s new content to,
    in pieces; it replaces `path` when the block ends without an exception. `mode` is "w"
    (text) or "wb" (bytes)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_writer: mode {mode!r}: use 'w' or 'wb'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path, perm)
    try:
        f = os.fdopen(fd, mode, encoding=encoding)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: "str | os.PathLike", data: bytes, *, perm: int = 0o666) -> None:
    """Write `data` to `path` atomically (see the module docstring)."""
    with atomic_writer(path, "wb", perm=perm) as f:
        f.write(data)


def atomic_write_text(path: "str | os.PathLike", text: str, *, perm: int = 0o666, encoding: str | None = None) -> None:
    """Write `text` to `path` atomically (see the module docstring)."""
    with atomic_writer(path, "w", perm=perm, encoding=encoding) as f:
        f.write(text)


def atomic_write_json(path: "str | os.PathLike", obj: Any, *, perm: int = 0o666, **json_kw: Any) -> None:
    """Write `json.dumps(obj, **json_kw)` to `path` atomically, exactly that text (no newline added)."""
    atomic_write_text(path, json.dumps(obj, **json_kw), perm=perm)


def sha256_file(path: "str | os.PathLike", chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def read_secret(path: "str | os.PathLike", label: str) -> str:
    """The stripped text of a secret file (a token, a key); a warning on stderr, `label` naming
    the file, when its group or others may read it. OSError when it cannot be read."""
    with open(path) as f:
        text = f.read().strip()
        mode = os.fstat(f.fileno()).st_mode
    if mode & 0o077:
        print(
            f"{label} {path} is readable by its group or others (mode {mode & 0o777:o}); chmod 600 {path}",
            file=sys.stderr,
            flush=True,
        )
    return text
