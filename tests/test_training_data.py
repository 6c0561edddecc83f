"""Shard reading, the data cursor, and clear errors for missing or mismatched shard sets."""

import json
import os
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from conftest import synthetic_shards

from dataprep import schema
from training.data import BatchLoader, DataCursor, DataError, ShardSet, read_batch, shard_ranks_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    return str(
        synthetic_shards(
            tmp_path_factory.mktemp("data"),
            users=300,
            items=120,
            seed=1,
            world_size=2,
            batch_size=8,
            max_len=16,
            max_history=60,
        )
    )


def test_batches_are_the_rank_files_rows_with_next_item_labels(shards):
    s = ShardSet(shards)
    f0, f1 = s.open_rank(0), s.open_rank(1)
    b = read_batch([f0, f1], 3)
    rows = pq.read_table(os.path.join(shards, schema.shard_file(0))).to_pylist()
    rows += pq.read_table(os.path.join(shards, schema.shard_file(1))).to_pylist()
    step_rows = [r for r in rows if r["step"] == 3]
    assert sorted(b.sample_ids.tolist()) == sorted(r["sample_id"] for r in step_rows)
    by_id = {r["sample_id"]: r for r in step_rows}
    for i, sid in enumerate(b.sample_ids.tolist()):
        lo, hi = int(b.offsets[i]), int(b.offsets[i + 1])
        r = by_id[sid]
        assert b.values[lo:hi].tolist() == r["items"]
        assert b.labels[lo:hi].tolist() == r["items"][1:] + [r["target"]]
    assert b.num_targets == sum(len(r["items"]) for r in step_rows)
    # loss.normalize=epoch divides by the mean tokens per step of the whole set
    assert s.tokens_per_step == pytest.approx(sum(len(r["items"]) for r in rows) / s.steps, rel=0.05)


def test_shard_rank_mapping():
    assert shard_ranks_for(4, 2, 1, 2, 0) == [2]  # group 1, rank 0 of 2 -> g*K+k
    assert shard_ranks_for(4, 1, 0, 2, 1) == [2, 3]  # 2 processes on a 4-rank set
    assert shard_ranks_for(2, 1, 0, 1, 0) == [0, 1]  # one process reads everything
    with pytest.raises(DataError, match="world_size=3 cannot feed 1 replica group.*2 rank"):
        shard_ranks_for(3, 1, 0, 2, 0)


def test_cursor_commit_and_retry(shards):
    s = ShardSet(shards)
    cursor = DataCursor(s.steps, seed=0)
    loader = BatchLoader(s, [0, 1], cursor, prefetch=2)
    first = loader.peek()
    again = loader.peek()  # not committed: the same batch
    assert torch.equal(first.sample_ids, again.sample_ids)
    seen = []
    for _ in range(2 * s.steps):
        seen.append(loader.peek().sample_ids)
        loader.commit()
    loader.close()
    epoch0 = torch.cat(seen[: s.steps]).sort().values
    epoch1 = torch.cat(seen[s.steps :]).sort().values
    assert torch.equal(epoch0, epoch1)  # every sample once per epoch
    assert len(set(epoch0.tolist())) == len(epoch0)
    order1 = [cursor.row_group(1, i) for i in range(s.steps)]
    assert sorted(order1) == list(range(s.steps)) and order1 != list(range(s.steps))
    c2 = DataCursor(s.steps, seed=0)
    c2.load_state_dict(cursor.state_dict())
    assert (c2.epoch, c2.index) == (2, 0) and c2.row_group(3, 1) == cursor.row_group(3, 1)


def _damaged(shards: str, tmp_path, how: str) -> str:
    d = str(tmp_path / how)
    shutil.copytree(shards, d)
    if how == "no_manifest":
        os.remove(os.path.join(d, schema.MANIFEST))
    elif how == "no_rank_file":
        os.remove(os.path.join(d, schema.shard_file(1)))
    elif how == "steps_mismatch":
        m = json.load(open(os.path.join(d, schema.MANIFEST)))
        m["steps"] += 1
        json.dump(m, open(os.path.join(d, schema.MANIFEST), "w"))
    elif how == "bad_json":
        open(os.path.join(d, schema.MANIFEST), "w").write("{not json")
    return d


@pytest.mark.parametrize(
    "how, words",
    [
        ("no_manifest", "manifest.json missing"),
        ("no_rank_file", "rank-00001.parquet missing"),
        ("steps_mismatch", "row groups, the manifest says"),
        ("bad_json", "not valid JSON"),
    ],
)
def test_damaged_sets_fail_clearly(shards, tmp_path, how, words):
    d = _damaged(shards, tmp_path, how)
    with pytest.raises(DataError, match=words):
        ShardSet(d).open_rank(1)


def test_cli_errors_are_one_line(shards, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cases = [
        (["--shards", str(tmp_path / "nowhere")], "not found"),
        (["--shards", _damaged(shards, tmp_path, "no_manifest")], "manifest.json missing"),
        (["--shards", shards, "--set", "model.attention=rnn"], "model.attention"),
    ]
    for args, words in cases:
        p = subprocess.run(
            [sys.executable, "-m", "training", "train", "--out", str(tmp_path / "o"), *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 2, p.stderr
        assert words in p.stderr and "Traceback" not in p.stderr
        assert len(p.stderr.strip().splitlines()) == 1


def test_world_size_mismatch_under_torchrun(tmp_path, shards, free_port):
    """A set built for 2 ranks cannot feed 3 processes: every rank says so and exits 2."""
    d = tmp_path / "ev3"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        [
            torchrun,
            "--nproc-per-node",
            "3",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port),
            "-m",
            "training",
            "train",
            "--shards",
            shards,
            "--out",
            str(d),
            "--set",
            "mlflow.enabled=false",
        ],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    assert p.returncode != 0
    assert "world_size=2 cannot feed 1 replica group(s) x 3 rank(s)" in out
