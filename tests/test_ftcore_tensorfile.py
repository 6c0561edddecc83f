"""The tensor-file reader on hostile bytes: only FormatError, never a huge allocation,
never uninitialized memory (a heal transfer comes from the network)."""

import io
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftcore import tensorfile
from ftcore.tensorfile import FormatError

VALID = tensorfile.dumps(
    {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3, "rng": torch.zeros(0)}, {"step": "3"}
)


def _file(header: dict | list, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(
    "raw,msg",
    [
        (_file({"t": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4 << 40]}}), "holds"),
        (_file({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 0]}}), "0 bytes for shape"),
        (_file({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "4 bytes for shape"),
        (_file({"t": {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]}}), "shape"),
        (_file({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}), "data_offsets"),
        (_file({"t": 7}), "not an object"),
        (_file([1, 2]), "not a JSON object"),
        (_file({"__metadata__": {"ftcore.tree": '{"$t": "nope"}'}}), "does not hold"),
        (_file({"__metadata__": {"ftcore.tree": "[" * 100000 + "]" * 100000}}), "malformed"),
        (_file({"__metadata__": {"ftcore.tree": '{"$d": [[[1], 2]]}'}}), "malformed"),
        (struct.pack("<Q", 1 << 30) + b"{}", "too large"),
        (b"\x01\x02", "stream ended"),
    ],
)
def test_malformed_files_raise_format_error_only(raw, msg):
    with pytest.raises(FormatError, match=msg):
        tensorfile.read(io.BytesIO(raw))


def test_a_valid_file_still_reads_and_an_empty_tensor_is_zeros():
    tree, meta = tensorfile.read(io.BytesIO(VALID))
    assert meta == {"step": "3"} and tree["step"] == 3
    assert torch.equal(tree["model"]["w"], torch.arange(6.0).reshape(2, 3)) and tree["rng"].numel() == 0


def test_a_lying_size_on_an_unsized_stream_fails_at_its_end_without_allocating_it():
    class Stream(io.RawIOBase):  # like an HTTP response: no length, no fileno
        def __init__(self, raw):
            self.b = io.BytesIO(raw)

        def readable(self):
            return True

        def readinto(self, buf):
            return self.b.readinto(buf)

    raw = _file({"t": {"dtype": "U8", "shape": [1 << 40], "data_offsets": [0, 1 << 40]}}, b"\0" * 100)
    with pytest.raises(FormatError, match="stream ended after 100"):
        tensorfile.read(io.BufferedReader(Stream(raw)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutated_files_raise_only_format_error(data):
    raw = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    try:
        tensorfile.read(io.BytesIO(bytes(raw)))
    except FormatError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_raise_only_format_error(raw):
    try:
        tensorfile.read(io.BytesIO(raw))
    except FormatError:
        pass
