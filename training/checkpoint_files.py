"""A checkpoint file's entry in its sealed meta.json, and the only way its bytes are read.

An entry is {"bytes": N, "piece": P, "sha256": [the sha256 of each P-byte piece, in order]}
(a file of one piece: its sha256 is the file's). `VerifiedFile` reads a piece into this
process's memory, checks its sha256 and only then serves it: torch.load unpickles nothing the
seal does not vouch for, and nothing can swap a file between the check and the load, while one
piece at a time is held (not a second copy of the file). No torch here.
"""

import hashlib
import io
import os

from training.checkpoint_key import CheckpointError

PIECE = 8 << 20  # bytes per hashed piece


def digest(path: str, piece: int | None = None) -> dict:
    """`path`'s entry: its size and each piece's sha256 (PIECE bytes by default)."""
    piece, hashes, size = piece or PIECE, [], 0
    with open(path, "rb") as f:
        while data := f.read(piece):
            hashes.append(hashlib.sha256(data).hexdigest())
            size += len(data)
    return {"bytes": size, "piece": piece, "sha256": hashes}


def mismatch(folder: str, name: str, size: int) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {folder}: {name} does not match the sha256 its sealed meta.json recorded when it was "
        f"written ({size} bytes now): the file is damaged or was rewritten; refusing it"
    )


def _valid(entry) -> bool:
    if not isinstance(entry, dict):
        return False
    size, piece, hashes = entry.get("bytes"), entry.get("piece"), entry.get("sha256")
    if not (isinstance(size, int) and isinstance(piece, int) and isinstance(hashes, list)):
        return False
    return size >= 0 and piece > 0 and len(hashes) == -(-size // piece) and all(isinstance(h, str) for h in hashes)


class VerifiedFile(io.RawIOBase):
    """FOLDER/NAME, seekable and readable, every byte served from a piece whose sha256 matched
    `entry`; CheckpointError (naming the folder and file) otherwise, also kept in `.error`."""

    def __init__(self, folder: str, name: str, entry):
        super().__init__()
        self.folder, self.name = folder, name
        self.error: CheckpointError | None = None
        if not _valid(entry):
            raise CheckpointError(f"checkpoint {folder}: meta.json's entry for {name} is damaged")
        self.size, self.piece, self.hashes = entry["bytes"], entry["piece"], entry["sha256"]
        try:
            self.fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise CheckpointError(f"checkpoint {folder}: {name} cannot be read ({e.strerror})") from None
        self.pos, self.held = 0, (-1, b"")
        now = os.fstat(self.fd).st_size
        if now != self.size:
            self.close()
            raise mismatch(folder, name, now)

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset)
        return self.pos

    def _piece(self, i: int) -> bytes:
        if self.held[0] != i:
            data = os.pread(self.fd, self.piece, i * self.piece)
            if hashlib.sha256(data).hexdigest() != self.hashes[i]:
                self.error = mismatch(self.folder, self.name, os.fstat(self.fd).st_size)
                raise self.error
            self.held = (i, data)
        return self.held[1]

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        n, done = max(0, min(len(view), self.size - self.pos)), 0
        while done < n:
            i, at = divmod(self.pos + done, self.piece)
            data = self._piece(i)
            k = min(len(data) - at, n - done)
            view[done : done + k] = data[at : at + k]
            done += k
        self.pos += done
        return done

    def check_all(self) -> None:
        """Read every piece (CheckpointError at the first that does not match)."""
        for i in range(len(self.hashes)):
            self._piece(i)
