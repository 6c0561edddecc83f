"""Timestamps through the pipeline: reader -> sequences -> shards (a column, version 2) ->
verify -> training batch and evaluation inputs; formats without time keep version 1."""

import json
import os
import random
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataprep import schema
from dataprep.build import build_shards
from dataprep.errors import DataprepError
from dataprep.sequences import seconds
from dataprep.verify import verify_shards
from training.config import EvalConfig, load_config
from training.data import ShardSet, read_batch
from training.evaluate import EvalData

T0 = 1_700_000_000  # epoch seconds


def _events(n_users=40, seed=0):
    """(user, item, epoch second) with distinct times inside each user, gaps from 1 s to days."""
    rng = random.Random(seed)
    rows = []
    for u in range(1, n_users + 1):
        t = T0 + rng.randrange(10**6)
        for k in range(rng.randrange(5, 12)):
            t += rng.choice([1, 7, 60, 3600, 86400 * 3])
            rows.append((u, 100 + (u * 7 + k * 13) % 60, t))
    rng.shuffle(rows)  # a log in no particular order: sequences sort by time
    return rows


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    d = tmp_path_factory.mktemp("timed")
    rows = _events()
    iso = lambda t: datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    (d / "ev.csv").write_text("user_id,item_id,timestamp\n" + "".join(f"{u},{i},{iso(t)}\n" for u, i, t in rows))
    m = build_shards(str(d / "ev.csv"), "events", str(d / "shards"), world_size=2, batch_size=4, max_len=6)
    return str(d / "shards"), rows, m


def _raw(shards, name):
    t = pq.read_table(os.path.join(shards, name)).sort_by("id")
    return dict(zip(t.column("id").to_pylist(), map(int, t.column("raw_id").to_pylist()), strict=True))


def test_seconds_reads_the_unit_from_the_magnitude():
    t = np.array([T0, T0 + 90], np.int64)
    for scale, unit in ((1, "s"), (10**3, "ms"), (10**6, "us"), (10**9, "ns")):
        got, u = seconds(t * scale)
        assert u == unit and got.tolist() == t.tolist()


def test_shards_carry_each_items_time_in_seconds(timed):
    shards, rows, m = timed
    assert m["format_version"] == 2 and m["timestamps"] == {"column": "timestamps", "unit": "s", "input_unit": "us"}
    assert verify_shards(shards)["format_version"] == 2
    when = {(u, i): t for u, i, t in rows}
    users, items = _raw(shards, schema.USER_MAP), _raw(shards, schema.ITEM_MAP)
    n = 0
    for r in range(2):
        t = pq.read_table(os.path.join(shards, schema.shard_file(r)))
        assert t.schema.equals(schema.SHARD_SCHEMA_TIME, check_metadata=False)
        for row in t.to_pylist():
            u = users[row["user_id"]]
            assert row["timestamps"] == [when[(u, items[i])] for i in row["items"]]
            n += 1
    assert n == m["counts"]["samples_written"]
    ev = pq.read_table(os.path.join(shards, schema.EVAL_FILE)).to_pylist()
    for row in ev:
        u = users[row["user_id"]]
        assert row["history_timestamps"] == [when[(u, items[i])] for i in row["history"]]
        assert row["valid_timestamp"] == when[(u, items[row["valid_target"]])]


def test_batch_and_eval_inputs_carry_the_same_times(timed):
    shards, _, _ = timed
    s = ShardSet(shards)
    assert s.has_time
    b = read_batch([s.open_rank(0), s.open_rank(1)], 0)
    rows = [
        r
        for k in range(2)
        for r in pq.ParquetFile(os.path.join(shards, schema.shard_file(k))).read_row_group(0).to_pylist()
    ]
    assert b.timestamps.tolist() == [t for r in rows for t in r["timestamps"]]
    assert b.timestamps.shape == b.values.shape
    ev = pq.read_table(os.path.join(shards, schema.EVAL_FILE)).to_pylist()
    data = EvalData(s.eval_path, s.num_items, 6, EvalConfig())
    test = data.splits["test"]
    by_input = {}
    for row in ev:  # the test input = history + valid item, its last 6
        key = tuple((row["history"] + [row["valid_target"]])[-6:])
        by_input.setdefault(key, set()).add(tuple((row["history_timestamps"] + [row["valid_timestamp"]])[-6:]))
    for k in range(len(test.targets)):
        a, z = int(test.offsets[k]), int(test.offsets[k + 1])
        assert tuple(test.timestamps[a:z].tolist()) in by_input[tuple(test.values[a:z].tolist())]
    assert data.splits["valid"].timestamps.shape == data.splits["valid"].values.shape


def test_hstu_trains_and_evaluates_on_timed_shards(timed, tmp_path):
    from training.train import train

    shards, _, _ = timed
    res = train(
        load_config(
            None,
            [
                f"data.shards={shards}",
                f"train.out={tmp_path / 'run'}",
                "train.max_steps=3",
                "model.attention=hstu",
                "model.dim=16",
                "loss.kind=sampled_softmax",
                "loss.num_negatives=16",
                "eval.periodic=false",
                "mlflow.enabled=false",
            ],
        )
    )
    assert res["steps"] == 3 and 0.0 <= res["metrics"]["test/full/hr@10"] <= 1.0


def test_formats_without_time_have_no_column(tmp_path):
    (tmp_path / "ev.txt").write_text("".join(f"{u} {i}\n" for u in range(1, 30) for i in range(1, 8)))
    m = build_shards(str(tmp_path / "ev.txt"), "sasrec", str(tmp_path / "s"), world_size=1, batch_size=4, max_len=5)
    assert m["format_version"] == 1 and "timestamps" not in m
    assert pq.read_schema(tmp_path / "s" / schema.shard_file(0)).equals(schema.SHARD_SCHEMA, check_metadata=False)
    assert pq.read_schema(tmp_path / "s" / schema.EVAL_FILE).equals(schema.EVAL_SCHEMA, check_metadata=False)
    assert read_batch([ShardSet(str(tmp_path / "s")).open_rank(0)], 0).timestamps is None
    verify_shards(str(tmp_path / "s"))


def test_verify_refuses_times_out_of_order(timed, tmp_path):
    import shutil

    shards, _, _ = timed
    d = tmp_path / "bad"
    shutil.copytree(shards, d)
    rel = schema.shard_file(0)
    f = pq.ParquetFile(d / rel)
    groups = [f.read_row_group(i) for i in range(f.num_row_groups)]
    row = next(k for k, n in enumerate(groups[0].column("length").to_pylist()) if n >= 2)
    ts = groups[0].column("timestamps").to_pylist()
    ts[row] = ts[row][::-1]
    groups[0] = groups[0].set_column(
        groups[0].schema.get_field_index("timestamps"),
        schema.SHARD_SCHEMA_TIME.field("timestamps"),
        pa.array(ts, pa.list_(pa.int64())),
    )
    with pq.ParquetWriter(d / rel, schema.SHARD_SCHEMA_TIME) as w:
        for g in groups:
            w.write_table(g)
    with pytest.raises(DataprepError, match="back in time"):
        verify_shards(str(d), checksums=False)
    m = json.loads((d / schema.MANIFEST).read_text())
    m["format_version"] = 1  # a version-1 manifest over a timed set: the schema differs
    (d / schema.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataprepError, match="schema differs"):
        verify_shards(str(d), checksums=False)
