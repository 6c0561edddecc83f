"""ftcore.util.files' atomic writes: whole content or the old file, no temporary file left
behind, permissions set when the file is created."""

import json
import os
import stat

import pytest

from ftcore import auth
from ftcore.util.files import atomic_write_bytes, atomic_write_json, atomic_write_text, atomic_writer


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_text_bytes_and_json_land_whole_with_open_default_permissions(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("x")  # what open() gives under this umask
    atomic_write_text(tmp_path / "sub" / "a.txt", "héllo\n")  # creates the folder
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    obj = {"b": 1, "a": [1.5, None]}
    atomic_write_json(tmp_path / "c.json", obj, indent=1, sort_keys=True)
    assert (tmp_path / "sub" / "a.txt").read_text() == "héllo\n"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "c.json").read_text() == json.dumps(obj, indent=1, sort_keys=True)  # exactly, no newline
    for p in (tmp_path / "sub" / "a.txt", tmp_path / "b.bin", tmp_path / "c.json"):
        assert _mode(p) == _mode(plain)
    assert sorted(p.name for p in tmp_path.rglob(".*")) == []


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_writer(path, "w") as f:
        f.write("half")
        raise RuntimeError("interrupted")
    with pytest.raises(TypeError):
        atomic_write_json(path, {"x": object()})
    with pytest.raises(RuntimeError), atomic_writer(str(path), "wb") as g:
        g.write(b"half")
        raise RuntimeError("interrupted")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.json"]


def test_streamed_write_replaces_the_file_at_the_end(tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(b"old")
    with atomic_writer(path, "wb") as f:
        for k in range(4):
            f.write(bytes([k]) * 10)
            assert path.read_bytes() == b"old"  # readers see the old file until the block ends
    assert path.read_bytes() == b"".join(bytes([k]) * 10 for k in range(4))


def test_private_file_is_private_from_creation(tmp_path, monkeypatch):
    created = []
    real_open = os.open

    def spy(p, flags, mode=0o777, *a, **kw):
        fd = real_open(p, flags, mode, *a, **kw)
        if flags & os.O_CREAT:
            created.append(_mode(p))
        return fd

    monkeypatch.setattr(os, "open", spy)
    atomic_write_text(tmp_path / "secret", "s", perm=0o600)
    token = auth.write_token_file(str(tmp_path / "token"))
    monkeypatch.undo()
    assert created == [0o600, 0o600]  # never wider, not even before the rename
    assert _mode(tmp_path / "secret") == 0o600 and _mode(tmp_path / "token") == 0o600
    assert auth.read_token_file(str(tmp_path / "token")) == token
    assert sorted(os.listdir(tmp_path)) == ["secret", "token"]


def test_mode_must_be_write_text_or_bytes(tmp_path):
    with pytest.raises(ValueError), atomic_writer(tmp_path / "x", "a"):
        pass
    assert not list(tmp_path.iterdir())
