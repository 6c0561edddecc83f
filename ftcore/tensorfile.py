"""A tensor-only serialization of nested state in the safetensors layout, written and read with
the standard library and torch alone: nothing is ever unpickled, and the `safetensors` package
loads our files. The non-tensor skeleton (dicts, numbers, lists) is JSON in the header's
`__metadata__` under `ftcore.tree`. Used for heals and for the groups' final states."""

import base64
import io
import json
import os
import struct
from typing import Any, BinaryIO, Protocol

import torch

from ftcore.util.files import atomic_writer

TREE_KEY = "ftcore.tree"
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
_TORCH = {v: k for k, v in _DTYPES.items()}


class FormatError(ValueError):
    """The bytes are not a tensor file this module can read."""


def _skeleton(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    def enc(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            name = path or "tensor"
            while name in tensors:
                name += "_"
            tensors[name] = x
            return {"$t": name}
        if type(x).__module__ == "numpy" and hasattr(x, "dtype") and hasattr(x, "shape"):
            name = enc(torch.from_numpy(x.copy()), path)["$t"]
            return {"$np": name}
        if isinstance(x, dict):
            return {"$d": [[enc(k, path), enc(v, f"{path}.{k}" if path else str(k))] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"$tu": [enc(v, f"{path}.{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{path}.{i}") for i, v in enumerate(x)]
        if isinstance(x, bytes):
            return {"$b": base64.b64encode(x).decode()}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if hasattr(x, "item") and type(x).__module__ == "numpy":  # numpy scalar
            return x.item()
        raise TypeError(
            f"ftcore.tensorfile: cannot store a {type(x).__name__} at '{path}'; "
            "state must be tensors, numbers, strings, lists, tuples and dicts"
        )

    return enc(tree, "")


def _rebuild(skel: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skel, list):
        return [_rebuild(v, tensors) for v in skel]
    if isinstance(skel, dict):
        if "$t" in skel or "$np" in skel:
            name = skel.get("$t", skel.get("$np"))
            if not isinstance(name, str) or name not in tensors:
                raise FormatError(f"the tree names a tensor {name!r} the file does not hold")
            return tensors[name] if "$t" in skel else tensors[name].numpy()
        if "$d" in skel:
            return {_rebuild(k, tensors): _rebuild(v, tensors) for k, v in skel["$d"]}
        if "$tu" in skel:
            return tuple(_rebuild(v, tensors) for v in skel["$tu"])
        if "$b" in skel:
            return base64.b64decode(skel["$b"])
        raise FormatError(f"unknown skeleton node {sorted(skel)}")
    return skel


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


class Sink(Protocol):
    """Where `write` puts the bytes: a file, a socket's stream (heal.py), a BytesIO."""

    def write(self, data: bytes | memoryview, /) -> Any: ...


def write(tree: Any, f: Sink, metadata: dict[str, str] | None = None) -> int:
    """Write `tree` to the binary stream `f`; returns the number of bytes written."""
    tensors: dict[str, torch.Tensor] = {}
    skel = _skeleton(tree, tensors)
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"ftcore.tensorfile: tensor '{name}' has unsupported dtype {t.dtype}")
    # Wider elements first keeps every tensor aligned without holes in the buffer.
    order = sorted(tensors, key=lambda n: -tensors[n].element_size())
    header: dict[str, Any] = {"__metadata__": {**(metadata or {}), TREE_KEY: json.dumps(skel)}}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for name in order:
        f.write(_as_bytes(tensors[name]))
    return 8 + len(raw) + offset


def dumps(tree: Any, metadata: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    write(tree, buf, metadata)
    return buf.getvalue()


_CHUNK = 16 << 20


def _read_exact(f: BinaryIO, n: int) -> bytearray:
    """n bytes, read in chunks: a declared size is believed only as far as bytes arrive, so a
    lying header costs at most what the stream really holds, never an allocation of n."""
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(min(n - len(buf), _CHUNK))
        if not chunk:
            raise FormatError(f"stream ended after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def _stream_length(f: BinaryIO) -> int | None:
    try:
        st = os.fstat(f.fileno())
    except (AttributeError, OSError, io.UnsupportedOperation):
        return len(f.getbuffer()) if isinstance(f, io.BytesIO) else None
    return st.st_size if st.st_mode & 0o170000 == 0o100000 else None  # regular files only


def _entry(name: str, v: Any) -> tuple[torch.dtype, list[int], int, int]:
    """(dtype, shape, begin, end) of one header entry, every field checked."""
    if not isinstance(v, dict):
        raise FormatError(f"tensor '{name}': header entry is not an object")
    raw = v.get("dtype")
    dtype = _TORCH.get(raw) if isinstance(raw, str) else None
    if dtype is None:
        raise FormatError(f"tensor '{name}' has unknown dtype {v.get('dtype')!r}")
    shape, offs = v.get("shape"), v.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) <= 64 and all(type(d) is int and d >= 0 for d in shape)):
        raise FormatError(f"tensor '{name}': shape {shape!r} is not a list of sizes")
    if not (isinstance(offs, list) and len(offs) == 2 and all(type(x) is int and x >= 0 for x in offs)):
        raise FormatError(f"tensor '{name}': data_offsets {offs!r} is not [begin, end]")
    numel = 1
    for d in shape:
        numel *= d
    b, e = offs
    if e - b != numel * torch.empty((), dtype=dtype).element_size():
        raise FormatError(f"tensor '{name}': {e - b} bytes for shape {shape} of {v['dtype']}")
    return dtype, shape, b, e


def read(f: BinaryIO, max_header: int = 64 << 20) -> tuple[Any, dict[str, str]]:
    """Read one tensor file from `f`: returns (tree, metadata). Raises FormatError, and only
    FormatError, for bytes that are not one (checked against the stream's length when known)."""
    try:
        return _read(f, max_header)
    except FormatError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, RecursionError, OverflowError, RuntimeError) as e:
        raise FormatError(f"malformed tensor file: {type(e).__name__}: {str(e)[:200]}") from None


def _read(f: BinaryIO, max_header: int) -> tuple[Any, dict[str, str]]:
    length = _stream_length(f)
    (n,) = struct.unpack("<Q", bytes(_read_exact(f, 8)))
    if n > max_header or (length is not None and 8 + n > length):
        raise FormatError(f"header of {n} bytes is too large for this stream")
    try:
        header = json.loads(bytes(_read_exact(f, n)))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise FormatError("header is not a JSON object")
    meta = header.pop("__metadata__", {}) or {}
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise FormatError("__metadata__ is not an object of strings")
    entries = sorted(((name, *_entry(name, v)) for name, v in header.items()), key=lambda x: x[3])
    end = max((x[4] for x in entries), default=0)
    if length is not None and 8 + n + end > length:
        raise FormatError(f"tensors need {end} bytes, the stream holds {length - 8 - n}")
    # Each tensor gets its own buffer (storage offset 0: torch's RNG set_state, for one,
    # reads from the start of the storage), read in byte order straight from the stream.
    tensors, pos = {}, 0
    for name, dtype, shape, begin, end_ in entries:
        if begin < pos:
            raise FormatError(f"tensor '{name}' has overlapping byte range {begin}..{end_}")
        if begin > pos:
            _read_exact(f, begin - pos)
        if end_ == begin:
            tensors[name] = torch.zeros(shape, dtype=dtype)  # no bytes: no elements (checked above)
        else:
            raw = _read_exact(f, end_ - begin)
            tensors[name] = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
        pos = end_
    tree = _rebuild(json.loads(meta[TREE_KEY]), tensors) if TREE_KEY in meta else tensors
    return tree, {k: v for k, v in meta.items() if k != TREE_KEY}


def loads(raw: bytes) -> Any:
    return read(io.BytesIO(raw))[0]


def save(tree: Any, path: str, metadata: dict[str, str] | None = None) -> None:
    """Write atomically: a temporary file in the same folder, fsynced, then os.replace."""
    with atomic_writer(path, "wb") as f:
        write(tree, f, metadata)


def load(path: str) -> Any:
    with open(path, "rb") as f:
        return read(f)[0]
