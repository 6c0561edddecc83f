"""A tensor-only serialization of nested state (model, optimizer, scheduler, RNG, cursor).

The byte layout is the safetensors format (8-byte little-endian header length, a JSON
header naming every tensor's dtype, shape and byte range, then the raw bytes), written
and read here with the standard library and torch alone, so anyone can load our files
with the `safetensors` package and nothing is ever unpickled. The non-tensor skeleton
of the state (dict keys, ints, floats, lists, tuples) is a JSON document stored in the
header's `__metadata__` under `ftcore.tree`, with `{"$t": name}` where a tensor was.

Used for heal transfers (heal.py) and for the launcher's final per-group state.
"""

import base64
import io
import json
import os
import struct
from typing import Any, BinaryIO

import torch

TREE_KEY = "ftcore.tree"
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
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
        raise TypeError(f"ftcore.tensorfile: cannot store a {type(x).__name__} at '{path}'; "
                        "state must be tensors, numbers, strings, lists, tuples and dicts")
    return enc(tree, "")


def _rebuild(skel: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skel, list):
        return [_rebuild(v, tensors) for v in skel]
    if isinstance(skel, dict):
        if "$t" in skel:
            return tensors[skel["$t"]]
        if "$np" in skel:
            return tensors[skel["$np"]].numpy()
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
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write(tree: Any, f: BinaryIO, metadata: dict[str, str] | None = None) -> int:
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


def _read_exact(f: BinaryIO, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise FormatError(f"stream ended after {got} of {n} bytes")
        got += k
    return buf


def read(f: BinaryIO, max_header: int = 64 << 20) -> tuple[Any, dict[str, str]]:
    """Read one tensor file from `f`: returns (tree, metadata). Raises FormatError."""
    (n,) = struct.unpack("<Q", bytes(_read_exact(f, 8)))
    if n > max_header:
        raise FormatError(f"header of {n} bytes is too large")
    try:
        header = json.loads(bytes(_read_exact(f, n)))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"header is not JSON: {e}") from None
    meta = header.pop("__metadata__", {}) or {}
    # Each tensor gets its own buffer (storage offset 0: torch's RNG set_state, for one,
    # reads from the start of the storage), read in byte order straight from the stream.
    tensors, pos = {}, 0
    for name, v in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype = _TORCH.get(v.get("dtype"))
        if dtype is None:
            raise FormatError(f"tensor '{name}' has unknown dtype {v.get('dtype')}")
        b, e = (int(x) for x in v["data_offsets"])
        if b < pos or e < b:
            raise FormatError(f"tensor '{name}' has overlapping byte range {b}..{e}")
        if b > pos:
            _read_exact(f, b - pos)
        shape = [int(x) for x in v["shape"]]
        if e == b:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(_read_exact(f, e - b), dtype=torch.uint8).view(dtype).reshape(shape)
        pos = e
    tree = _rebuild(json.loads(meta[TREE_KEY]), tensors) if TREE_KEY in meta else tensors
    return tree, {k: v for k, v in meta.items() if k != TREE_KEY}


def loads(raw: bytes) -> Any:
    return read(io.BytesIO(raw))[0]


def save(tree: Any, path: str, metadata: dict[str, str] | None = None) -> None:
    """Write atomically: a temporary file in the same folder, then os.replace."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        write(tree, f, metadata)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: str) -> Any:
    with open(path, "rb") as f:
        return read(f)[0]
