"""Synthetic data (deterministic, heavy-tailed, Zipf) and the cost model (fit, load, calibrate)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dataprep import cost, readers, sequences, synth
from dataprep.errors import DataprepError
from dataprep.synth import write_synthetic

ROOT = Path(__file__).resolve().parent.parent


def test_synth_is_deterministic_by_seed(tmp_path):
    a = write_synthetic(tmp_path / "a.txt", users=300, items=100, seed=5)
    b = write_synthetic(tmp_path / "b.txt", users=300, items=100, seed=5)
    c = write_synthetic(tmp_path / "c.txt", users=300, items=100, seed=6)
    assert Path(a).read_bytes() == Path(b).read_bytes() != Path(c).read_bytes()


@pytest.mark.parametrize(
    "fmt,rfmt,name",
    [
        ("sasrec", "sasrec", "s.txt"),
        ("iclrec", "iclrec", "i.txt"),
        ("events", "events", "e.parquet"),
        ("events-csv", "events", "e.csv"),
    ],
)
def test_synth_formats_read_back_to_the_same_sequences(tmp_path, monkeypatch, fmt, rfmt, name):
    monkeypatch.setattr(synth, "CHUNK_USERS", 128)  # several chunks
    kw = dict(users=500, items=300, seed=2, max_history=200)
    seq = sequences.build_sequences(readers.read(write_synthetic(tmp_path / name, fmt=fmt, **kw), rfmt))
    ref = sequences.build_sequences(readers.read(write_synthetic(tmp_path / "ref.txt", **kw), "sasrec"))
    assert np.array_equal(seq.offsets, ref.offsets) and np.array_equal(seq.values, ref.values)
    assert seq.num_users == 500


def test_synth_shape_heavy_tail_and_zipf(tmp_path):
    p = write_synthetic(
        tmp_path / "s.txt", users=20_000, items=5000, seed=0, median_len=20, sigma=1.2, max_history=3000
    )
    seq = sequences.build_sequences(readers.read(p, "sasrec"))
    n = np.diff(seq.offsets)
    assert 15 <= np.median(n) <= 25 and n.min() >= 5 and n.max() > 1000  # lognormal tail into the thousands
    pop = np.sort(np.bincount(seq.values))[::-1]
    top = pop[: len(pop) // 100].sum() / pop.sum()
    assert top > 0.3  # the top 1% of items take a large share: Zipf, not uniform (~1%)


def test_synth_markov_makes_a_sequence_to_learn(tmp_path):
    kw = dict(users=400, items=300, seed=3, median_len=60, max_history=300)
    plain = write_synthetic(tmp_path / "p.txt", **kw)
    assert Path(write_synthetic(tmp_path / "z.txt", markov=0.0, **kw)).read_bytes() == Path(plain).read_bytes()
    seq = sequences.build_sequences(readers.read(write_synthetic(tmp_path / "m.txt", markov=0.5, **kw), "sasrec"))
    v, first = seq.values.astype(np.int64), np.zeros(len(seq.values), bool)
    first[seq.offsets[:-1]] = True
    pairs = np.stack([v[:-1], v[1:]], 1)[~first[1:]]  # consecutive events of one user
    # each item's most frequent next item (its successor) follows it in about half of the events
    top = {}
    for a, b in pairs:
        top.setdefault(a, {}).setdefault(b, 0)
        top[a][b] += 1
    share = sum(max(d.values()) for d in top.values()) / len(pairs)
    assert 0.45 < share < 0.7
    with pytest.raises(DataprepError, match="markov"):
        write_synthetic(tmp_path / "x.txt", users=2, items=3, markov=1.0)


def test_fit_recovers_coefficients():
    L = np.array([8, 16, 32, 64, 128, 256, 512])
    n = np.tile([4, 8], len(L))
    LL = np.repeat(L, 2)
    t = n * (0.03 * LL**2 + 20 * LL + 100) + 500
    a, b, c0, o = cost.fit_batched(LL, n, t)
    assert a == pytest.approx(0.03, rel=1e-6) and b == pytest.approx(20, rel=1e-6)
    assert c0 == pytest.approx(100, rel=1e-5) and o == pytest.approx(500, rel=1e-5)
    y = 5 * L + 2 - 1e-4 * L**2
    a, b, c0 = cost.fit(L, y)  # a negative quadratic term is dropped, never kept...
    slope, intercept = np.polyfit(L, y, 1)
    assert a == 0  # ... and the rest is the least-squares line through the same points
    assert b == pytest.approx(slope, rel=1e-9) and c0 == pytest.approx(intercept, rel=1e-9)


def test_cost_model_load_and_validate(tmp_path):
    assert cost.load_cost_model(None) == cost.DEFAULT
    m = cost.load_cost_model({"a": 1, "b": 0, "c0": 0})
    assert m([1, 2, 3]).tolist() == [1, 4, 9]
    p = tmp_path / "c.json"
    p.write_text("{not json")
    with pytest.raises(DataprepError, match="not a readable JSON"):
        cost.load_cost_model(str(p))
    with pytest.raises(DataprepError, match="needs keys a, b, c0"):
        cost.load_cost_model({"a": 1})
    with pytest.raises(DataprepError, match="c\\(1\\) <= 0"):
        cost.load_cost_model({"a": 0, "b": 0, "c0": 0})


def test_calibrate_cli_writes_a_usable_model(tmp_path):
    out = tmp_path / "cost.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataprep",
            "calibrate",
            "--out",
            str(out),
            "--lengths",
            "8,32,128",
            "--batch",
            "2",
            "--repeats",
            "1",
            "--quiet",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    m = cost.load_cost_model(str(out))
    assert m.source == "calibrated:standin" and m(128) > m(8) > 0
    assert json.loads(out.read_text())["fit"]["lengths"] == [8, 32, 128]


def test_calibrate_times_a_model_the_caller_passes_and_refuses_unknown_names():
    """dataprep imports nothing of training: the training model's timing comes in as `step`."""
    calls = []

    def step(length, batch):
        calls.append((length, batch))
        return lambda: sum(range(length * batch * 50))

    m = cost.calibrate([4, 8, 16], batch=2, repeats=1, model="mine", step=step)
    assert m.source == "calibrated:mine" and m(16) > 0 and {L for L, _ in calls} == {4, 8, 16}
    with pytest.raises(DataprepError, match="ftrec calibrate"):
        cost.calibrate([8, 16, 32], model="training")


def test_bench_smoke_agrees_with_pandas_and_writes_json(tmp_path):
    """The benchmark script runs end to end at a tiny size; its pandas baseline builds the same samples."""
    out = tmp_path / "b.json"
    r = subprocess.run(
        [
            sys.executable,
            "benchmarks/dataprep_bench.py",
            "--samples",
            "20000",
            "--world-sizes",
            "8",
            "--windows",
            "1,64",
            "--events",
            "30000",
            "--repeats",
            "1",
            "--skip-shared",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    k1, k64 = d["balance"]
    assert k64["bubble_balanced"] < k1["bubble_balanced"] < k1["bubble_random"]
    t = d["throughput"]
    assert t["samples"] > 0 and t["speedup_vs_pandas"] > 0 and "dataprep" in r.stdout
