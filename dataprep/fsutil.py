"""Atomic file and folder writes, and input fingerprints."""

import hashlib
import os
import tempfile
from pathlib import Path


def atomic_write_text(path: "str | os.PathLike", text: str) -> None:
    """Write `text` to `path` via a temporary file in the same folder and os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sha256_file(path: "str | os.PathLike", chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def fingerprint(paths: list[str]) -> str:
    """SHA-256 over the input files' names-free content, in order (renaming a file keeps it).
    A folder (a Parquet dataset) counts as its data files in path order, skipping the
    hidden and `_`-prefixed ones pyarrow skips too."""
    h = hashlib.sha256()
    for p in paths:
        files = [p] if not os.path.isdir(p) else sorted(
            str(f) for f in Path(p).rglob("*")
            if f.is_file() and not any(part.startswith((".", "_")) for part in f.relative_to(p).parts))
        for f in files:
            h.update(sha256_file(f).encode())
    return h.hexdigest()
