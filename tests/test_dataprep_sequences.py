"""Readers + sequences against a plain-Python reference, over every input format (hypothesis)."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataprep import readers, sequences

# raw user id -> list of (item, time) with strictly increasing times
histories = st.dictionaries(
    st.integers(0, 10**6), st.lists(st.integers(0, 50), min_size=1, max_size=12), min_size=2, max_size=12
)


def _reference(hist: dict[int, list[int]], max_len: int):
    """Plain Python leave-one-out on raw ids; returns {raw user: (train items, target, history, valid, test)}."""
    kept = {u: s for u, s in hist.items() if len(s) >= 3}
    items = sorted({i for s in kept.values() for i in s})
    dense = {i: k + 1 for k, i in enumerate(items)}
    out = {}
    for u in sorted(kept):
        s = [dense[i] for i in kept[u]]
        train = s[:-2]
        sample = None
        if len(train) >= 2:
            t = train[-(max_len + 1) :]
            sample = (t[:-1], t[-1])
        out[u] = (sample, train, s[-2], s[-1])
    return out, len(items)


def _run(ev: readers.Interactions, max_len: int):
    seq = sequences.build_sequences(ev)
    evt = sequences.eval_table(seq).to_pydict()
    smp = sequences.train_samples(seq, max_len)
    raw = seq.user_raw.to_pylist()
    got = {}
    samples = {int(u): (it, int(tg)) for u, it, tg in zip(smp.user_id, smp.items.to_pylist(), smp.target, strict=True)}
    for u, h, v, t in zip(evt["user_id"], evt["history"], evt["valid_target"], evt["test_target"], strict=True):
        got[raw[u - 1]] = (samples.get(u), h, v, t)
    assert seq.values.min() >= 1 and seq.values.max() == seq.num_items
    return got, seq.num_items


def _write(tmp, fmt, hist, rng):
    events = [(u, i, t) for u, s in hist.items() for t, i in enumerate(s)]
    if fmt == "sasrec":  # interleave users; order inside a user is the line order
        order = sorted(range(len(events)), key=lambda k: (events[k][2], rng.random()))
        p = tmp / "in.txt"
        p.write_text("".join(f"{events[k][0]} {events[k][1]}\n" for k in order))
    elif fmt == "iclrec":
        p = tmp / "in.txt"
        p.write_text("".join(f"{u} {' '.join(map(str, s))}\n" for u, s in hist.items()))
    elif fmt == "movielens":
        rng.shuffle(events)
        p = tmp / "ratings.dat"
        p.write_text("".join(f"{u}::{i}::5::{1000 + 10 * t}\n" for u, i, t in events))
    elif fmt == "events-csv":
        rng.shuffle(events)
        p = tmp / "ev.csv"
        p.write_text("uid,ts,iid\n" + "".join(f"u{u},{1000 + t},{i}\n" for u, i, t in events))
    else:
        rng.shuffle(events)
        p = tmp / "ev.parquet"
        pq.write_table(
            pa.table(
                {
                    "user_id": [e[0] for e in events],
                    "item_id": [e[1] for e in events],
                    "timestamp": pa.array([e[2] * 10**6 for e in events], pa.timestamp("us")),
                }
            ),
            p,
        )
    return p


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    hist=histories,
    max_len=st.integers(1, 6),
    seed=st.integers(0, 9),
    fmt=st.sampled_from(["sasrec", "iclrec", "movielens", "events-csv", "events"]),
)
def test_every_format_matches_reference(tmp_path_factory, hist, max_len, seed, fmt):
    tmp = tmp_path_factory.mktemp("f")
    p = _write(tmp, fmt, hist, np.random.default_rng(seed))
    opts = {"user_col": "uid", "item_col": "iid", "time_col": "ts"} if fmt == "events-csv" else {}
    rfmt = "events" if fmt.startswith("events") else fmt
    want, n_items = _reference(hist, max_len)
    if not want:
        return
    ev = readers.read(str(p), rfmt, **opts)
    got, got_items = _run(ev, max_len)
    if fmt == "events-csv":  # raw ids are strings "u<id>"
        got = {int(k[1:]) if isinstance(k, str) else k: v for k, v in got.items()}
    assert got_items == n_items
    assert got == want


def test_time_order_is_stable_and_duplicates_are_rejected():
    ev = readers.Interactions(
        user=pa.array([7, 7, 7, 7, 7, 7], pa.int64()),
        item=pa.array([5, 3, 4, 3, 9, 8], pa.int64()),
        ts=np.array([2, 1, 1, 1, 3, 0]),
        source=np.zeros(6, np.int32),
        line=np.arange(1, 7),
        paths=["x.csv"],
        has_time=True,
    )
    seq = sequences.build_sequences(ev)
    raw = seq.item_raw.to_pylist()
    assert [raw[i - 1] for i in seq.values] == [8, 3, 4, 5, 9]  # ties keep input order; (7,3,1) twice -> once
    rej = seq.rejects[0].to_pydict()
    assert rej["reason"] == ["duplicate_event"] and rej["line"] == [4]


def test_consecutive_dedup_and_max_events():
    ev = readers.Interactions(
        user=pa.array([1] * 6 + [2] * 3, pa.int64()),
        item=pa.array([1, 1, 2, 3, 3, 4, 1, 2, 3], pa.int64()),
        ts=np.arange(9),
        source=np.zeros(9, np.int32),
        line=np.arange(1, 10),
        paths=["x"],
        has_time=False,
    )
    assert sequences.build_sequences(ev).counts["duplicates"] == 0  # no timestamps: repeats are real
    seq = sequences.build_sequences(ev, dedup="consecutive")
    assert seq.counts["duplicates"] == 2 and np.diff(seq.offsets).tolist() == [4, 3]
    seq = sequences.build_sequences(ev, max_events=4)
    assert seq.num_users == 1 and seq.rejects[0].to_pydict()["reason"] == ["history_too_long"]


def test_truncation_keeps_most_recent():
    ev = readers.Interactions(
        user=pa.array([1] * 103, pa.int64()),
        item=pa.array(list(range(1, 104)), pa.int64()),
        ts=np.arange(103),
        source=np.zeros(103, np.int32),
        line=np.arange(1, 104),
        paths=["x"],
        has_time=False,
    )
    s = sequences.train_samples(sequences.build_sequences(ev), 10)
    assert s.items.to_pylist() == [list(range(91, 101))] and s.target.tolist() == [101]
    assert s.truncated == 1 and s.items_truncated == 90


def test_stable_argsort_is_numpys_stable_sort():
    """The (user, time) order: numpy's stable argsort, ties (equal keys) in index order."""
    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 17, 5000):
        for hi in (1, 3, 1000, 1 << 60):
            key = rng.integers(0, hi, n)
            assert np.array_equal(sequences.stable_argsort(key), np.argsort(key, kind="stable")), (n, hi)


@pytest.mark.parametrize("top", [3, 1 << 20, 1 << 45, 1 << 62])
def test_stable_argsort_is_numpys_stable_argsort(top):
    """Both ways (one value sort of key and index packed, where they fit in 63 bits; an
    unstable argsort with its ties put back in order, where they do not) give numpy's stable
    order, ties (many at top=3) in index order."""
    rng = np.random.default_rng(top % 1000)
    for n in (0, 1, 2, 5000):
        key = rng.integers(0, top, n, dtype=np.int64)
        assert np.array_equal(sequences.stable_argsort(key), np.argsort(key, kind="stable")), (top, n)


@pytest.mark.parametrize("case", ["a log", "time ties", "one user out of order late", "random times", "many users"])
def test_events_ordered_by_user_then_time_ties_in_input_order(case):
    """_order: the stable (user, time) order, whichever way it takes (a stable sort by user
    alone where each user's events already come in time order and users fit 16 bits)."""
    rng = np.random.default_rng(7)
    n = 20_000
    user = rng.integers(0, 300_000 if case == "many users" else 900, n)
    ts = np.sort(rng.integers(0, 10**6, n))  # a log: in time order
    if case == "time ties":
        ts //= 1000
    elif case == "one user out of order late":
        last = np.flatnonzero(user == user[-1])
        ts[last[-2:]] = ts[last[-2:]][::-1] - [0, 1]  # the user's last two events swapped
    elif case == "random times":
        ts = rng.integers(0, 10**6, n)
    want = np.lexsort((np.arange(n), ts, user))
    assert np.array_equal(sequences._order(user, ts), want)
