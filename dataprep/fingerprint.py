"""The fingerprint of a shard set's inputs: SHA-256 over their content, local or through pyarrow.fs."""

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dataprep.files import sha256_file


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


def fingerprint_later(paths: list[str]) -> "Future[str]":
    """`fingerprint(paths)` taken in a thread of its own (it ends with the hash)."""
    ex = ThreadPoolExecutor(1)
    try:
        return ex.submit(fingerprint, paths)
    finally:
        ex.shutdown(wait=False)
