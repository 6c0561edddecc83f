"""The global temporal split (dataprep --split temporal): no event after the cut trains, every
test event lies in the window after it, every test user has history before it, the cut and
horizon are in the manifest, and the trainer evaluates and tracks it."""

import csv
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_dataprep_bucketed import _assert_same
from test_dataprep_bucketed import _events as _messy_events

from dataprep import bucketed, schema, temporal
from dataprep.build import build_shards
from dataprep.errors import DataprepError
from dataprep.synth import write_synthetic
from dataprep.verify import verify_shards

T0 = 1_700_000_000
DAY = 86_400


def _events(path: Path, users: int = 120, seed: int = 0) -> dict[tuple[str, str], int]:
    """A CSV event log (user, item, epoch second), each user's items distinct, spread over 100
    days; returns {(user, item): time}."""
    rng = random.Random(seed)
    times = {}
    for u in range(users):
        t = T0 + rng.randrange(60 * DAY)
        for item in rng.sample(range(1, 80), rng.randrange(3, 14)):
            t += rng.choice([60, 3600, DAY, 5 * DAY])
            times[f"u{u}", f"i{item}"] = t
    rows = list(times.items())
    rng.shuffle(rows)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["user_id", "item_id", "timestamp"])
        w.writerows([u, i, t] for (u, i), t in rows)
    return times


def _raw(shards: Path, rel: str) -> list[str]:
    return pq.read_table(shards / rel).column("raw_id").to_pylist()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("temporal")
    times = _events(root / "events.csv")
    cut, horizon = T0 + 50 * DAY, 10 * DAY
    shards = root / "shards"
    m = build_shards(
        str(root / "events.csv"),
        "events",
        str(shards),
        world_size=1,
        batch_size=8,
        max_len=6,
        split="temporal",
        cut=cut,
        horizon=horizon,
    )
    return times, cut, horizon, shards, m


def test_no_event_after_the_cut_trains_and_every_test_user_has_history(built):
    times, cut, horizon, shards, m = built
    users, items = _raw(shards, schema.USER_MAP), _raw(shards, schema.ITEM_MAP)

    def t(u: int, i: int) -> int:
        return times[users[u - 1], items[i - 1]]

    trained = pq.read_table(shards / schema.shard_file(0)).to_pylist()
    assert trained
    for row in trained:  # every input and every target of every training sample
        assert all(t(row["user_id"], i) <= cut for i in [*row["items"], row["target"]])
        assert row["timestamps"] == [t(row["user_id"], i) for i in row["items"]]
    ev = pq.read_table(shards / schema.EVAL_FILE).to_pylist()
    for row in ev:
        u = row["user_id"]
        assert row["history"], "a test user without history before the cut"
        assert all(t(u, i) <= cut for i in [*row["history"], row["valid_target"]])
        assert cut < t(u, row["test_target"]) <= cut + horizon
        # the test event is the user's first after the cut
        after = [tt for (uu, _), tt in times.items() if uu == users[u - 1] and tt > cut]
        assert t(u, row["test_target"]) == min(after)
        # a tested user's validation event is held out of training: its samples end before it
        assert all(r["target"] != row["valid_target"] for r in trained if r["user_id"] == u)
    # every user with 2 events before the cut and one in the window is tested, no one else
    by_user: dict[str, list[int]] = {}
    for (u, _), tt in times.items():
        by_user.setdefault(u, []).append(tt)
    want = {
        u
        for u, ts in by_user.items()
        if len(ts) >= 3 and sum(x <= cut for x in ts) >= 2 and any(cut < x <= cut + horizon for x in ts)
    }
    assert {users[r["user_id"] - 1] for r in ev} == want
    # the manifest records the split; the set verifies (eval rows = counts.eval_users)
    split = m["split"]
    assert (split["kind"], split["cut"], split["horizon"], split["cut_from"]) == ("temporal", cut, horizon, "--cut")
    assert split["test_users"] == len(ev) == m["counts"]["eval_users"] < m["num_users"]
    assert m["config"]["split"] == "temporal"
    verify_shards(str(shards))


def test_the_cut_defaults_to_the_events_own_times(tmp_path):
    times = _events(tmp_path / "events.csv", seed=1)
    m = build_shards(
        str(tmp_path / "events.csv"), "events", str(tmp_path / "s"), world_size=1, batch_size=8, split="temporal"
    )
    ts = np.array(sorted(times.values()))
    split = m["split"]
    assert split["cut"] == int(np.quantile(ts, 0.9, method="lower"))
    assert split["horizon"] == int(ts.max()) - split["cut"]  # to the last event
    assert split["events_after_cut"] == int((ts > split["cut"]).sum())


def test_what_a_user_gets_wrong_is_named(tmp_path):
    _events(tmp_path / "events.csv")
    (tmp_path / "plain.txt").write_text("".join(f"{u} {i}\n" for u in range(5) for i in range(1, 6)))
    with pytest.raises(DataprepError, match="--split temporal needs event times: --format sasrec has none"):
        build_shards(
            str(tmp_path / "plain.txt"), "sasrec", str(tmp_path / "a"), world_size=1, batch_size=4, split="temporal"
        )
    for buckets in (None, 2):  # the bucketed build says it in the same words
        with pytest.raises(DataprepError, match="no user has 2 events at or before the cut"):
            build_shards(
                str(tmp_path / "events.csv"),
                "events",
                str(tmp_path / "c"),
                world_size=1,
                batch_size=4,
                split="temporal",
                cut=T0,
                buckets=buckets,
            )
    with pytest.raises(DataprepError, match="--cut and --horizon belong to --split temporal"):
        build_shards(str(tmp_path / "events.csv"), "events", str(tmp_path / "d"), world_size=1, batch_size=4, cut=T0)


def test_leave_one_out_sets_are_unchanged(tmp_path):
    """The default split writes no split entries: the manifest's config and keys as before."""
    _events(tmp_path / "events.csv")
    m = build_shards(str(tmp_path / "events.csv"), "events", str(tmp_path / "s"), world_size=1, batch_size=8)
    assert "split" not in m and not {"split", "cut", "horizon"} & set(m["config"])
    assert m["counts"]["eval_users"] == m["num_users"]
    assert json.loads((tmp_path / "s" / schema.MANIFEST).read_text())["counts"]["eval_users"] == m["num_users"]


def test_the_trainer_scores_the_window_and_tracks_the_cut(built, tmp_path):
    """Training on a temporal set: the test users are the window's, the metrics come with
    coverage@10 and the most-popular baseline, and the cut and horizon are MLflow params."""
    from training.config import ConfigError, load_config
    from training.train import train

    _, cut, horizon, shards, m = built
    base = [
        f"data.shards={shards}",
        f"train.out={tmp_path / 'run'}",
        "model.dim=16",
        "loss.kind=sampled_softmax",
        "loss.num_negatives=16",
    ]
    base += ["train.epochs=1", "mlflow.log_model=false", "mlflow.plots=false", "mlflow.system_metrics=false"]
    with pytest.raises(ConfigError, match="eval.split='leave_one_out', but shard set .* was built with 'temporal'"):
        train(load_config(None, [*base, "eval.split=leave_one_out"]))
    res = train(load_config(None, [*base, "eval.split=temporal"]))
    metrics = res["metrics"]
    assert 0 < metrics["test/full/coverage@10"] <= 1
    assert {"baseline/popular/test/full/hr@10", "baseline/popular/test/full/ndcg@10"} <= set(metrics)
    import mlflow

    params = mlflow.MlflowClient(tracking_uri=res["tracking_uri"]).get_run(res["mlflow_run_id"]).data.params
    assert (params["data.split.kind"], params["data.split.cut"]) == ("temporal", str(cut))
    assert params["data.split.horizon"] == str(horizon) and params["eval.split"] == "temporal"
    assert params["data.split.test_users"] == str(m["split"]["test_users"])


@pytest.mark.parametrize(
    "values",
    [
        [5],
        [3, 3, 3],
        [9, 1, 4, 1, 5, 9, 2, 6],
        [-7, 0, 7, 1 << 40],
        list(range(1000)),
        [T0 + x for x in range(0, 10**7, 997)],
    ],
)
def test_the_cut_over_chunks_is_numpys_lower_quantile(values):
    """temporal.window's cut, taken a chunk at a time in a few passes (the bucketed build's
    buckets), is np.quantile(..., 0.9, method="lower") of all the times at once."""
    ts = np.random.default_rng(len(values)).permutation(np.array(values, np.int64))
    chunks = np.array_split(ts, 3)
    t, end = temporal.window(lambda: iter(chunks), None, None)
    assert (t, end) == (int(np.quantile(ts, temporal.CUT_QUANTILE, method="lower")), int(ts.max()))
    assert temporal.window(lambda: iter(chunks), 4, 10) == (4, 14)  # given: taken as they are
    with pytest.raises(DataprepError, match="needs event times"):
        temporal.window(lambda: iter([ts[:0]]), None, None)


def _timed_input(root: Path, which: str) -> str:
    """A synthetic event log (Parquet, in time order), or a messy one: duplicates, time ties,
    users too short and too long, times in milliseconds, in several row groups."""
    if which == "synth":
        return write_synthetic(str(root / "synth.parquet"), users=700, items=150, seed=4, fmt="events", median_len=8)
    pq.write_table(
        pa.table(_messy_events(np.random.default_rng(8), 900, 25_000)), root / "m.parquet", row_group_size=6000
    )
    return str(root / "m.parquet")


@pytest.mark.parametrize("which", ["synth, default cut", "messy, cut and horizon given"])
def test_the_bucketed_build_is_the_in_memory_temporal_set_byte_for_byte(tmp_path, monkeypatch, which):
    """The fanned-out build's stages (dataprep.bucketed, as Airflow runs them) give the in-memory
    build's temporal set: the same cut and window (the manifest's split), shards, eval table."""
    monkeypatch.setattr(bucketed, "PIECE_ROWS", 7)  # rank pieces in many batches
    path = _timed_input(tmp_path, which.split(",")[0])
    kw = dict(world_size=3, batch_size=8, max_len=12, seed=1, split="temporal")
    if which.startswith("messy"):  # the window a week into its 11 days
        kw |= dict(cut=1_600_000_000 + 6 * DAY, horizon=2 * DAY, max_events=300, tail="drop")
    ref = build_shards(path, "events", str(tmp_path / "ref"), **kw)
    for buckets in (1, 4):
        build_shards(path, "events", str(tmp_path / f"b{buckets}"), buckets=buckets, **kw)
        _assert_same(tmp_path / "ref", tmp_path / f"b{buckets}")
    split = ref["split"]
    assert 0 < split["test_users"] == ref["counts"]["eval_users"] < ref["num_users"]
    if which.startswith("messy"):
        r = ref["rejects"]
        assert r["duplicate_event"] and r["too_short"] and r["history_too_long"] and r["tail_dropped"], r
    assert split["cut_from"] == ("--cut" if "cut" in kw else f"quantile {temporal.CUT_QUANTILE} of the event times")
    verify_shards(str(tmp_path / "b4"))
