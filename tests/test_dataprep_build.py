"""End to end: synth/shared data -> shards -> verify; atomic writes, idempotence, CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from dataprep import build, schema
from dataprep.build import build_shards
from dataprep.errors import DataprepError
from dataprep.synth import write_synthetic
from dataprep.verify import verify_shards

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "dataprep", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def synth_file(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("syn") / "s.txt", users=2000, items=500, seed=1, max_history=300)


def _read_all(out, w):
    return [pq.read_table(Path(out) / schema.shard_file(r)) for r in range(w)]


def test_synth_shards_verify_roundtrip(tmp_path, synth_file):
    out = tmp_path / "set"
    m = build_shards(synth_file, "sasrec", str(out), world_size=4, batch_size=16, max_len=50, seed=3)
    assert verify_shards(str(out))["input"]["fingerprint"] == m["input"]["fingerprint"]
    assert m["config"]["world_size"] == 4 and m["steps"] == 2000 // 64
    for r, _t in enumerate(_read_all(out, 4)):
        f = pq.ParquetFile(out / schema.shard_file(r))
        assert f.num_row_groups == m["steps"]
        for i in range(f.num_row_groups):
            g = f.read_row_group(i)
            assert set(g.column("step").to_pylist()) == {i} and set(g.column("rank").to_pylist()) == {r}
    ids = np.concatenate([t.column("sample_id").to_numpy() for t in _read_all(out, 4)])
    assert sorted(ids) == list(range(m["num_samples"]))
    assert m["bubble_fraction"] < m["bubble_fraction_random"]
    assert set(m["files"]) == {schema.shard_file(r) for r in range(4)} | {
        schema.EVAL_FILE,
        schema.USER_MAP,
        schema.ITEM_MAP,
        schema.REJECTS_FILE,
    }
    for key in ("created_at", "input", "config", "num_users", "num_items", "counts", "rejects", "imbalance"):
        assert key in m


def test_samples_match_eval_and_leave_one_out(tmp_path, synth_file):
    out = tmp_path / "set"
    build_shards(synth_file, "sasrec", str(out), world_size=2, batch_size=8, max_len=20)
    ev = pq.read_table(out / schema.EVAL_FILE).to_pydict()
    hist = dict(zip(ev["user_id"], ev["history"], strict=True))
    rows = [row for t in _read_all(out, 2) for row in t.to_pylist()]
    for row in rows[:300]:
        h = hist[row["user_id"]]
        assert row["items"] == h[-21:-1] and row["target"] == h[-1]
        assert row["length"] == min(len(h) - 1, 20)


def test_idempotent_refuses_different_and_overwrites(tmp_path, synth_file):
    out = tmp_path / "set"
    m1 = build_shards(synth_file, "sasrec", str(out), world_size=2, batch_size=8)
    m2 = build_shards(synth_file, "sasrec", str(out), world_size=2, batch_size=8)
    assert m2["created_at"] == m1["created_at"]  # not rebuilt
    with pytest.raises(DataprepError, match="different shard set"):
        build_shards(synth_file, "sasrec", str(out), world_size=4, batch_size=8)
    m3 = build_shards(synth_file, "sasrec", str(out), world_size=4, batch_size=8, overwrite=True)
    assert m3["config"]["world_size"] == 4
    verify_shards(str(out))
    assert [p.name for p in tmp_path.iterdir()] == ["set"]  # no temp or old folder left behind


def test_overwrite_never_deletes_what_is_not_a_shard_set(tmp_path, synth_file):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("a user's file")
    with pytest.raises(DataprepError, match="holds no shard set"):
        build_shards(synth_file, "sasrec", str(out), world_size=2, batch_size=8, overwrite=True)
    assert (out / "notes.txt").read_text() == "a user's file"


def test_an_output_folder_holding_the_input_is_refused(tmp_path, synth_file):
    out = tmp_path / "set"
    build_shards(synth_file, "sasrec", str(out), world_size=2, batch_size=8)
    inside = out / "events.txt"
    inside.write_bytes(Path(synth_file).read_bytes())
    with pytest.raises(DataprepError, match="contains the input"):
        build_shards(str(inside), "sasrec", str(out), world_size=4, batch_size=8, overwrite=True)
    assert inside.exists()
    with pytest.raises(DataprepError, match="contains the input"):  # the folder itself as input
        build_shards(str(tmp_path), "sasrec", str(tmp_path), world_size=2, batch_size=8, overwrite=True)


def test_crash_mid_write_leaves_nothing_valid(tmp_path, synth_file, monkeypatch):
    out = tmp_path / "set"

    def boom(path, table, **options):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(build, "_write_parquet", boom)
    with pytest.raises(OSError):
        build_shards(synth_file, "sasrec", str(out), world_size=2, batch_size=8)
    assert list(tmp_path.iterdir()) == []


def test_verify_catches_tampering(tmp_path, synth_file):
    out = tmp_path / "set"
    build_shards(synth_file, "sasrec", str(out), world_size=2, batch_size=8)
    f = out / schema.shard_file(1)
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(DataprepError, match="SHA-256"):
        verify_shards(str(out))
    f.unlink()
    with pytest.raises(DataprepError, match="missing"):
        verify_shards(str(out))


def test_verify_catches_duplicate_sample_even_with_matching_checksums(tmp_path, synth_file):
    """A set whose checksums were recomputed after an edit still fails exactly-once coverage."""
    out = tmp_path / "set"
    build_shards(synth_file, "sasrec", str(out), world_size=2, batch_size=8)
    rel = schema.shard_file(0)
    f = pq.ParquetFile(out / rel)
    groups = [f.read_row_group(i) for i in range(f.num_row_groups)]
    ids = groups[0].column("sample_id").to_numpy().copy()
    ids[0] = groups[1].column("sample_id")[0].as_py()
    import pyarrow as pa

    groups[0] = groups[0].set_column(0, schema.SHARD_SCHEMA.field("sample_id"), pa.array(ids))
    with pq.ParquetWriter(out / rel, schema.SHARD_SCHEMA) as w:
        for g in groups:
            w.write_table(g)
    from ftcore.util.files import sha256_file

    m = json.loads((out / schema.MANIFEST).read_text())
    m["files"][rel] = sha256_file(out / rel)
    (out / schema.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataprepError, match="more than once"):
        verify_shards(str(out))


def test_verify_rejects_folder_without_manifest(tmp_path):
    with pytest.raises(DataprepError, match="no manifest.json"):
        verify_shards(str(tmp_path))


@pytest.mark.parametrize("name,fmt", [("beauty.txt", "iclrec"), ("video.txt", "sasrec")])
def test_shared_datasets_end_to_end(tmp_path, shared_data, name, fmt):
    out = tmp_path / "set"
    m = build_shards(str(shared_data / name), fmt, str(out), world_size=8, batch_size=64, max_len=50)
    verify_shards(str(out))
    published = {"beauty.txt": (22363, 12101, 198502), "video.txt": (31013, 23715, 287107)}[name]
    assert m["counts"]["users_read"] == published[0]
    assert m["counts"]["events_read"] == published[2]
    assert m["num_users"] + m["counts"]["users_rejected"] == published[0]
    assert m["num_items"] <= published[1]
    assert m["imbalance"]["p50"] < 1.02
    assert m["bubble_fraction"] < 0.2 * m["bubble_fraction_random"]
    if name == "beauty.txt":  # 5-core, ids already dense 1..N: they are kept
        um = pq.read_table(out / schema.USER_MAP).to_pydict()
        assert um["raw_id"][:3] == ["1", "2", "3"] and m["num_items"] == published[1]


def test_cli_shards_verify_and_errors(tmp_path, synth_file):
    out = tmp_path / "set"
    r = _cli(
        "shards",
        "--input",
        synth_file,
        "--format",
        "sasrec",
        "--out",
        out,
        "--world-size",
        2,
        "--batch-size",
        8,
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and r.stdout == ""  # --quiet silences the progress bar and summary
    r = _cli("verify", out)
    assert r.returncode == 0 and r.stdout.startswith("ok:")
    (out / schema.EVAL_FILE).write_bytes(b"junk")
    r = _cli("verify", out)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    assert "eval.parquet" in r.stderr
    r = _cli(
        "shards",
        "--input",
        synth_file,
        "--format",
        "sasrec",
        "--out",
        tmp_path / "s2",
        "--world-size",
        100000,
        "--batch-size",
        8,
    )
    assert r.returncode == 1 and "larger than the data allows" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "s2").exists()


def test_cli_help_for_every_command(capsys):
    from dataprep.cli import main

    for cmd in ("synth", "shards", "verify", "calibrate"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0 and "usage: python -m dataprep " + cmd in capsys.readouterr().out


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lens=st.lists(st.integers(1, 80), min_size=1, max_size=60),
    w=st.integers(1, 6),
    b=st.integers(1, 5),
    k=st.integers(1, 8),
    tail=st.sampled_from(["fill", "drop"]),
    max_len=st.integers(1, 30),
)
def test_any_small_input_builds_a_set_that_verifies_or_errors_clearly(tmp_path_factory, lens, w, b, k, tail, max_len):
    tmp = tmp_path_factory.mktemp("h")
    p = tmp / "in.txt"
    p.write_text("".join(f"{u} {(u * 31 + j) % 97 + 1}\n" for u, n in enumerate(lens, 1) for j in range(n)))
    n_samples = sum(n >= 4 for n in lens)
    try:
        m = build_shards(
            str(p), "sasrec", str(tmp / "out"), world_size=w, batch_size=b, window_steps=k, tail=tail, max_len=max_len
        )
    except DataprepError as e:
        assert n_samples < w or (tail == "drop" and n_samples < w * b) or n_samples == 0 or "leave-one-out" in str(e)
        assert not (tmp / "out").exists()
        return
    assert m["num_samples"] == n_samples and m["num_users"] == sum(n >= 3 for n in lens)
    verify_shards(str(tmp / "out"))


def test_kill_9_during_write_leaves_no_valid_set_and_next_build_cleans_up(tmp_path):
    """A real SIGKILL in the middle of writing: no set at --out; the next build succeeds and
    removes the dead build's temporary folder."""
    import signal
    import time

    src = write_synthetic(tmp_path / "big.txt", users=20_000, items=2000, seed=0, max_history=100)
    out = tmp_path / "set"
    cmd = [
        sys.executable,
        "-m",
        "dataprep",
        "shards",
        "--input",
        src,
        "--format",
        "sasrec",
        "--out",
        str(out),
        "--world-size",
        "256",
        "--batch-size",
        "1",
        "--quiet",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        temps = []
        while time.monotonic() < deadline and proc.poll() is None:
            temps = [d for d in tmp_path.glob(".set.tmp-*") if (d / "shards").exists()]
            if temps and len(list((temps[0] / "shards").iterdir())) >= 2:
                break
            time.sleep(0.005)
        assert temps and proc.poll() is None, "the build finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert not out.exists()
    assert temps[0].exists()  # the dead build's folder: never named like a set
    with pytest.raises(DataprepError):
        verify_shards(str(temps[0]))  # and not valid-looking either: no manifest
    m = build_shards(src, "sasrec", str(out), world_size=4, batch_size=64)
    verify_shards(str(out))
    assert m["num_samples"] > 0 and not temps[0].exists()
