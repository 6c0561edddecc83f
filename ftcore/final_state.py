"""The layout of a replica group's final state (OUT/replica_<g>/): rank 0's
`state.safetensors`, and `state.rank<k>.safetensors` per rank k when the ranks' states differ
(a sharded table); every file's metadata names its `step`, and the launcher prints one
checksum over a group's files. Standard library only (the launcher reads it without torch)."""

import hashlib
import json


def file_name(rank: int) -> str:
    """Rank `rank`'s final state file in its group's output folder (rank 0's is the group's)."""
    return "state.safetensors" if rank == 0 else f"state.rank{rank}.safetensors"


def checksum(paths: str | list[str]) -> str:
    """sha256 (16 hex digits) of the files' bytes, concatenated in the order given (rank
    order). One file: the hash of that file; the files are safetensors, each
    self-delimiting, so the concatenation names one set of files."""
    h = hashlib.sha256()
    for path in [paths] if isinstance(paths, str) else paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def metadata(path: str) -> dict[str, str]:
    """The `__metadata__` of a safetensors file, read from its header alone."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= 64 << 20:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        return json.loads(f.read(n)).get("__metadata__") or {}
