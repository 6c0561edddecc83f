"""ftcore's atomic file write (internal; used by auth.py and tensorfile.py).

The same rule as dataprep.fsutil.atomic_writer, kept here because ftcore depends on nothing
else in the repository: the content goes to a new temporary file in the same folder
(`.NAME.XXXXXXXX.tmp`), created with `perm` (less the umask) so a private file is private
from its first byte, then it is flushed, fsynced and renamed over `path`. On any failure the
temporary file is removed and `path` is left as it was. Standard library only.
"""

import contextlib
import os
import secrets
from collections.abc import Iterator
from typing import BinaryIO


@contextlib.contextmanager
def atomic_writer(path: str, *, perm: int = 0o666) -> Iterator[BinaryIO]:
    """`with atomic_writer(path) as f:` a binary file whose content replaces `path` when the
    block ends without an exception."""
    folder, name = os.path.split(os.fspath(path))
    for _ in range(100):
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, perm)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary name beside {path}")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
