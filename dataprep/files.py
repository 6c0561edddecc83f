"""Files that appear whole or not at all, and their hashes: dataprep's own, so that data
preparation stands beside ftcore rather than on it (ftcore keeps the same small helpers).

`staged(path)` hands out a temporary path beside `path` (the same folder, so the rename is
atomic) for any writer, pyarrow's included; when the block ends without an exception the file
is fsynced and renamed over `path`, else it is removed and `path` is left as it was."""

import contextlib
import hashlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staged(path: "str | os.PathLike") -> Iterator[Path]:
    """`with staged(out) as tmp:` write `tmp`; it becomes `out` when the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the content is on disk before the name points at it
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: "str | os.PathLike", text: str) -> None:
    """`text` as `path`'s whole new content, atomically."""
    with staged(path) as tmp:
        tmp.write_text(text)


def sha256_file(path: "str | os.PathLike", chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()
