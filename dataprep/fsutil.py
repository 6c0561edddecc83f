"""Atomic file and folder writes, and input fingerprints.

A file written here appears complete or not at all: written to `.NAME.XXXXXXXX.tmp` in the
same folder, flushed and fsynced, then renamed over `path`; on failure the temporary file is
removed and `path` is left as it was (the folder is not fsynced). `perm` applies when the
temporary file is created (less the umask): 0o600 keeps a file private from its first byte.
"""

import contextlib
import hashlib
import json
import os
import secrets
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


def _uri_files(uri: str) -> list[tuple[Any, str]]:
    """(filesystem, path) of each data file of a `scheme://` input, as `fingerprint` orders them."""
    import pyarrow.fs as pafs

    fs, inner = pafs.FileSystem.from_uri(uri)
    if fs.get_file_info(inner).type != pafs.FileType.Directory:
        return [(fs, inner)]
    infos = fs.get_file_info(pafs.FileSelector(inner, recursive=True))
    keep = [
        i.path
        for i in infos
        if i.type == pafs.FileType.File
        and not any(part.startswith((".", "_")) for part in i.path[len(inner) :].strip("/").split("/"))
    ]
    return [(fs, f) for f in sorted(keep)]


def _sha256_stream(fs: Any, path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with fs.open_input_stream(path) as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def fingerprint(paths: list[str]) -> str:
    """SHA-256 over the input files' names-free content, in order (renaming a file keeps it).
    A folder (a Parquet dataset) counts as its data files in path order, skipping the
    hidden and `_`-prefixed ones pyarrow skips too. A `scheme://` input is read through
    pyarrow.fs (its bytes give the same fingerprint as a local copy)."""
    h = hashlib.sha256()
    for p in paths:
        if "://" in str(p):
            for fs, f in _uri_files(str(p)):
                h.update(_sha256_stream(fs, f).encode())
            continue
        files = (
            [p]
            if not os.path.isdir(p)
            else sorted(
                str(f)
                for f in Path(p).rglob("*")
                if f.is_file() and not any(part.startswith((".", "_")) for part in f.relative_to(p).parts)
            )
        )
        for f in files:
            h.update(sha256_file(f).encode())
    return h.hexdigest()
