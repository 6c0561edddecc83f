"""Ranking metrics and both evaluation protocols against hand-computed cases."""

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dataprep import schema
from training import ranking
from training.config import EvalConfig, ModelConfig
from training.evaluate import EvalData, MostPopular, evaluate, ranking_metrics
from training.model import SeqRec


def test_ranking_metrics_by_hand():
    m = ranking_metrics(np.array([0, 3, 10, 60]), (1, 5, 10, 50))
    assert m["hr@1"] == 0.25 and m["hr@5"] == 0.5 and m["hr@10"] == 0.5 and m["hr@50"] == 0.75
    assert m["ndcg@5"] == pytest.approx((1 + 1 / math.log2(5)) / 4)
    assert m["ndcg@50"] == pytest.approx((1 + 1 / math.log2(5) + 1 / math.log2(12)) / 4)
    assert m["mrr"] == pytest.approx((1 + 1 / 4 + 1 / 11 + 1 / 61) / 4)
    assert "ndcg@1" not in m  # NDCG@1 == HR@1; the brief asks NDCG@{5,10,50}


@pytest.fixture
def tiny(tmp_path) -> str:
    """3 users, 5 items. History counts: item1 1, item2 3, item3 1, item4 1, item5 0."""
    t = pa.table(
        {
            "user_id": [1, 2, 3],
            "history": [[1, 2], [2, 3], [2, 4]],
            "valid_target": [3, 5, 1],
            "test_target": [4, 1, 3],
        },
        schema=schema.EVAL_SCHEMA,
    )
    pq.write_table(t, tmp_path / "eval.parquet")
    return str(tmp_path / "eval.parquet")


def _by_user(data: EvalData, split: str):
    s = data.splits[split]
    seqs = [s.values[s.offsets[i] : s.offsets[i + 1]].tolist() for i in range(len(s.targets))]
    return sorted(zip(seqs, s.targets.tolist(), s.negatives.tolist(), strict=True))


def test_split_inputs_and_negatives(tiny):
    d = EvalData(tiny, num_items=5, max_len=2, cfg=EvalConfig(num_negatives=3))
    valid = _by_user(d, "valid")
    test = _by_user(d, "test")
    assert [(x, t) for x, t, _ in valid] == [([1, 2], 3), ([2, 3], 5), ([2, 4], 1)]
    # test input = history + valid target, truncated to the most recent max_len = 2
    assert [(x, t) for x, t, _ in test] == [([2, 3], 4), ([3, 5], 1), ([4, 1], 3)]
    # each user has exactly one item never interacted with: all negatives are that item
    assert {tuple(x): n for x, _, n in valid} == {(1, 2): [5, 5, 5], (2, 3): [4, 4, 4], (2, 4): [5, 5, 5]}
    again = EvalData(tiny, num_items=5, max_len=2, cfg=EvalConfig(num_negatives=3))
    assert _by_user(again, "test") == test  # fixed seed: the same negatives every run


def test_protocols_on_most_popular(tiny):
    cfg = EvalConfig(ks=(1, 5), num_negatives=3)
    d = EvalData(tiny, num_items=5, max_len=50, cfg=cfg)
    m = evaluate(MostPopular(d), d, cfg)
    # full, history excluded, ties count against the target:
    #  valid ranks: u1 target 3 vs {3,4,5} -> 1; u2 target 5 vs {1,4,5} -> 2; u3 target 1 vs {1,3,5} -> 1
    assert m["valid/full/hr@1"] == 0.0 and m["valid/full/hr@5"] == 1.0
    assert m["valid/full/mrr"] == pytest.approx((1 / 2 + 1 / 3 + 1 / 2) / 3)
    assert m["valid/full/ndcg@5"] == pytest.approx((2 / math.log2(3) + 1 / math.log2(4)) / 3)
    #  test ranks: u1 4 vs {4,5} -> 0; u2 1 vs {1,4} -> 1; u3 3 vs {3,5} -> 0
    assert m["test/full/mrr"] == pytest.approx((1 + 1 / 2 + 1) / 3)
    # sampled: u1 3(1) vs 5(0) -> 0; u2 5(0) vs 4(1) x3 -> 3; u3 1(1) vs 5(0) -> 0
    assert m["valid/sampled/hr@1"] == pytest.approx(2 / 3)
    assert m["valid/sampled/mrr"] == pytest.approx((1 + 1 / 4 + 1) / 3)
    # without exclusion u1's target 3 ties with 1 and 4 and trails 2: rank 3
    m2 = evaluate(MostPopular(d), d, EvalConfig(ks=(1, 5), num_negatives=3, exclude_history=False))
    assert m2["valid/full/mrr"] == pytest.approx((1 / 4 + 1 / 5 + 1 / 4) / 3)


def _dense_ranks(model, data: EvalData, cfg: EvalConfig, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The reference: every user scored against the whole catalogue at once ([B, items])."""
    s = data.splits[split]
    full, sampled = [], []
    for lo in range(0, len(s.targets), cfg.batch_size):
        hi = min(lo + cfg.batch_size, len(s.targets))
        a, b = int(s.offsets[lo]), int(s.offsets[hi])
        offsets, values, target = s.offsets[lo : hi + 1] - a, s.values[a:b], s.targets[lo:hi]
        h = model.last_hidden(values, offsets)
        scores = model.scores(h)
        t_score = scores.gather(1, (target - 1)[:, None])
        if cfg.exclude_history:
            rows = torch.repeat_interleave(torch.arange(hi - lo), offsets[1:] - offsets[:-1])
            scores[rows, values - 1] = float("-inf")
            scores.scatter_(1, (target - 1)[:, None], t_score)
        full.append(((scores >= t_score).sum(1) - 1).numpy())
        sampled.append((scores.gather(1, s.negatives[lo:hi] - 1) >= t_score).sum(1).numpy())
    return np.concatenate(full), np.concatenate(sampled)


class _ChunkSpy(SeqRec):
    """A real SeqRec that records the widest score matrix evaluation asked of it."""

    widest = 0

    def scores(self, h, items=None):
        out = super().scores(h, items)
        self.widest = max(self.widest, out.shape[1])
        return out


@pytest.fixture
def random_eval(tmp_path) -> str:
    """60 users over 500 items, histories of 1..30 items."""
    rng = np.random.default_rng(3)
    hist = [rng.choice(np.arange(1, 501), size=int(rng.integers(1, 31)), replace=False) for _ in range(60)]
    valid = [int(rng.integers(1, 501)) for _ in hist]
    test = [int(rng.integers(1, 501)) for _ in hist]
    t = pa.table(
        {"user_id": list(range(60)), "history": [h.tolist() for h in hist], "valid_target": valid, "test_target": test},
        schema=schema.EVAL_SCHEMA,
    )
    pq.write_table(t, tmp_path / "eval.parquet")
    return str(tmp_path / "eval.parquet")


@pytest.mark.parametrize("similarity", ["cosine", "dot"])
@pytest.mark.parametrize("exclude", [True, False])
def test_streamed_ranking_equals_dense_ranking(random_eval, similarity, exclude):
    """Chunks of 37 items (not a divisor of 500), batches of 16 users: the same ranks, hence
    the same HR/NDCG/MRR, as scoring all 500 items at once; never more than 37 items scored."""
    torch.manual_seed(0)
    model = _ChunkSpy(500, ModelConfig(dim=16, num_layers=1, num_heads=2, max_len=30, similarity=similarity)).eval()
    cfg = EvalConfig(batch_size=16, item_chunk=37, exclude_history=exclude, num_negatives=20)
    data = EvalData(random_eval, num_items=500, max_len=30, cfg=cfg)
    got = evaluate(model, data, cfg)
    assert model.widest == 37
    with torch.no_grad():
        for split in ("valid", "test"):
            full, sampled = _dense_ranks(model, data, cfg, split)
            assert len(set(full.tolist())) > 10  # the model separates items: ranks vary
            for proto, ranks in (("full", full), ("sampled", sampled)):
                for k, v in ranking_metrics(ranks, tuple(cfg.ks)).items():
                    assert got[f"{split}/{proto}/{k}"] == v, (split, proto, k)


def test_ties_across_chunks_count_against_the_target(tiny):
    """MostPopular ties (equal counts) split over chunks of 2 items rank as in one chunk."""
    for exclude in (True, False):
        one = EvalConfig(ks=(1, 5), num_negatives=3, exclude_history=exclude)
        d = EvalData(tiny, num_items=5, max_len=50, cfg=one)
        chunked = EvalConfig(ks=(1, 5), num_negatives=3, exclude_history=exclude, item_chunk=2)
        assert evaluate(MostPopular(d), d, chunked) == evaluate(MostPopular(d), d, one)


# --- bf16-bounded full ranking (training/ranking.py): the reference's ranks, bit for bit

CPU = torch.device("cpu")


def _model(num_items: int, dim: int, similarity: str, seed: int = 0) -> SeqRec:
    torch.manual_seed(seed)
    cfg = ModelConfig(dim=dim, num_layers=1, num_heads=2, max_len=30, similarity=similarity, dropout=0.0)
    return SeqRec(num_items, cfg).eval()


def _batch(model: SeqRec, num_items: int, B: int, num_neg: int, seed: int):
    """Hidden states of B random histories, targets, negatives (some = the target) and history."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 31, (B,), generator=g)
    offsets = torch.zeros(B + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    values = torch.randint(1, num_items + 1, (int(offsets[-1]),), generator=g)
    target = torch.randint(1, num_items + 1, (B,), generator=g)
    negatives = torch.randint(1, num_items + 1, (B, num_neg), generator=g)
    negatives[:, 0] = target  # a negative that is the target ties with it
    rows = torch.repeat_interleave(torch.arange(B), lengths)
    with torch.no_grad():
        return model.last_hidden(values, offsets), target, negatives, (rows, values)


def _both(model, num_items: int, chunk: int, h, target, negatives, history, fast_chunk: int = ranking.FAST_CHUNK):
    """(reference ranks, bounded ranks, the bounded ranker)."""
    with torch.no_grad():
        ref = ranking.rank_targets(model, h, target, negatives, history, num_items, chunk)
        ranker = ranking.BoundedRanker(model, num_items, chunk, fast_chunk)
        got = ranker.rank(h, target, negatives, history)
    return ref, got, ranker


def _bounded_runs_here(rows: int, num_items: int, chunk: int, dim: int):
    shapes = {min(chunk, num_items), num_items % chunk or chunk}
    if not ranking.bf16_sound(CPU) or not all(ranking.chain_verified(rows, n, dim, CPU) for n in shapes):
        pytest.skip("this CPU's float32 matmul is not a plain fma chain (or bf16 is unsound): the reference runs")


@pytest.mark.parametrize(
    "similarity,dim,num_items,chunk,B,exclude",
    [
        ("dot", 16, 3000, 37, 48, True),  # reference chunks of 37: fast chunks of 8177, one padded block
        ("cosine", 16, 3000, 37, 48, False),
        ("dot", 64, 20011, 2048, 128, True),  # a last chunk of 1579 items
        ("cosine", 32, 9000, 500, 64, True),
    ],
)
def test_bounded_ranks_equal_the_reference(similarity, dim, num_items, chunk, B, exclude):
    """Random models and catalogues: the same full and sampled ranks as float32 scoring, with
    the bounded path taken (no fallback) and some items left to exact rescoring."""
    _bounded_runs_here(B, num_items, chunk, dim)
    model = _model(num_items, dim, similarity)
    h, target, negatives, history = _batch(model, num_items, B, 30, seed=dim)
    ref, got, ranker = _both(model, num_items, chunk, h, target, negatives, history if exclude else None)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert ranker.counts["plain_batches"] == 0 and ranker.counts["band_pairs"] > 0
    assert len(set(ref[0].tolist())) > B // 2  # ranks spread: a real test of the counting


def test_bounded_ranks_equal_the_reference_on_two_threads():
    """Chunks split between two worker threads (one torch thread each): the same ranks."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _bounded_runs_here(96, 30000, 1000, 32)
        model = _model(30000, 32, "cosine")
        h, target, negatives, history = _batch(model, 30000, 96, 30, seed=3)
        ref, got, ranker = _both(model, 30000, 1000, h, target, negatives, history, fast_chunk=4000)
        assert len(ranker._workers) == 2 and ranker.counts["plain_batches"] == 0
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        assert torch.get_num_threads() == 2  # the workers' one thread each is undone
    finally:
        torch.set_num_threads(before)


def _adversarial(dim: int = 32, num_items: int = 6000, B: int = 64):
    """Items tied with or an ulp away from each target's score, duplicates, zero, huge and tiny
    norms in the same chunks; rows of zero, huge and tiny hidden states."""
    model = _model(num_items, dim, "dot", seed=5)
    W = model.item_emb.weight.data
    g = torch.Generator().manual_seed(7)
    target = torch.randint(400, num_items // 2, (B,), generator=g)
    target[-4:] = torch.tensor([3, 150, 250, 399])  # some with huge and tiny norms too
    for i, t in enumerate(target.tolist()):
        base = num_items // 2 + 40 * i
        W[base : base + 10] = W[t]  # exact duplicates: ties
        W[base + 10 : base + 20] = W[t] * (1 + 2.0**-23 * torch.arange(-5, 5)[:, None])  # an ulp or so apart
        W[base + 20, :] = W[t]
        W[base + 20, 0] = torch.nextafter(W[t, 0], torch.tensor(1.0))  # one component an ulp up
        W[base + 21, :] = 0.0
    W[1:200] *= 1e6  # huge norms at the catalogue's start, tiny ones after
    W[200:400] *= 1e-6
    W[0] = 0.0
    h = torch.randn(B, dim, generator=g)
    h[0] = 0.0  # every item scores 0 and ties with the target
    h[1] *= 1e8
    h[2] *= 1e-8
    negatives = torch.randint(1, num_items + 1, (B, 20), generator=g)
    negatives[:, :5] = num_items // 2 + 40 * torch.arange(B)[:, None] + torch.tensor([0, 10, 15, 20, 21])
    history = (
        torch.arange(B).repeat_interleave(3),
        (num_items // 2 + 40 * torch.arange(B))[:, None].add(torch.tensor([1, 11, 30])).flatten(),
    )
    return model, num_items, h, target, negatives, history


def test_bounded_ranks_equal_the_reference_on_ties_and_extreme_norms():
    model, num_items, h, target, negatives, history = _adversarial()
    _bounded_runs_here(len(target), num_items, 256, 32)
    ref, got, ranker = _both(model, num_items, 256, h, target, negatives, history, fast_chunk=512)
    assert ranker.counts["plain_batches"] == 0
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert int(ref[0][0]) == num_items - 1 - 3  # the zero row: everything ties, less the target and its 3 history items


def test_a_bound_too_tight_is_caught(monkeypatch):
    """The comparison can fail: a scale 2^12 too large (error bound broken) changes ranks."""
    model, num_items, h, target, negatives, history = _adversarial()
    _bounded_runs_here(len(target), num_items, 256, 32)
    scale = ranking.BoundedRanker._scale
    monkeypatch.setattr(ranking.BoundedRanker, "_scale", lambda self, rows, s: scale(self, rows, s) * 2.0**12)
    ref, got, _ = _both(model, num_items, 256, h, target, negatives, history, fast_chunk=512)
    assert not (torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]))


def test_small_batches_fall_back_to_the_reference():
    """One user: float32 products are gemv-shaped (not fma chains), so the reference ranks it."""
    model = _model(3000, 16, "dot")
    h, target, negatives, history = _batch(model, 3000, 1, 10, seed=1)
    ref, got, ranker = _both(model, 3000, 256, h, target, negatives, history)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert ranker.counts["plain_batches"] == int(not ranking.chain_verified(1, 256, 16, CPU)) == 1


def test_fma_dot_rounds_once_at_a_float32_midpoint():
    """1 + a*b whose float64 sum is a float32 midpoint but whose exact value is above it: one
    fma (and MKL's sgemm) rounds up; rounding the float64 sum again would round to even."""
    a = torch.tensor([[1.0, 1 + 2.0**-12]] * 16)
    b = torch.tensor([[1.0, (1 - 2.0**-12 + 2.0**-24) * 2.0**-24]] * 16)
    assert (torch.tensor(1.0, dtype=torch.float64) + a[0, 1].double() * b[0, 1].double()).float() == 1.0
    assert ranking.fma_dot(a, b).tolist() == [1 + 2.0**-23] * 16
    if ranking.chain_verified(16, 16, 2, CPU):
        assert (a @ b.T).diagonal().tolist() == [1 + 2.0**-23] * 16


def test_fma_dot_is_the_float32_matmul():
    g = torch.Generator().manual_seed(0)
    q, e = torch.randn(64, 48, generator=g) * 3, torch.randn(300, 48, generator=g) * 0.02
    if not ranking.chain_verified(64, 300, 48, CPU):
        pytest.skip("this CPU's float32 matmul is not a plain fma chain")
    rows, cols = torch.arange(64).repeat_interleave(300), torch.arange(300).repeat(64)
    assert torch.equal(ranking.fma_dot(q[rows], e[cols]), (q @ e.T).flatten())
    assert torch.equal(ranking.exact_dot(q[rows], e[cols]), (q @ e.T).flatten())


def test_make_ranker_by_precision(tiny):
    model = _model(100, 16, "dot")
    assert isinstance(ranking.make_ranker(model, 100, 37, "fp32", CPU), ranking.ReferenceRanker)
    assert isinstance(ranking.make_ranker(model, 100, 37, "bf16", CPU), ranking.BoundedRanker)
    auto = ranking.make_ranker(model, 100, 37, "auto", CPU)
    assert isinstance(auto, ranking.BoundedRanker) == ranking.fast_bf16(CPU)
    d = EvalData(tiny, num_items=5, max_len=50, cfg=EvalConfig(num_negatives=3))
    assert isinstance(ranking.make_ranker(MostPopular(d), 5, 37, "bf16", CPU), ranking.ReferenceRanker)


@pytest.mark.parametrize("similarity", ["cosine", "dot"])
def test_evaluate_bf16_equals_fp32(random_eval, similarity):
    """evaluate() end to end: eval.precision=bf16 gives the fp32 metrics exactly."""
    model = _model(500, 16, similarity)
    metrics = {}
    for precision in ("fp32", "bf16"):
        cfg = EvalConfig(batch_size=32, item_chunk=37, num_negatives=20, precision=precision)
        metrics[precision] = evaluate(model, EvalData(random_eval, num_items=500, max_len=30, cfg=cfg), cfg)
    assert metrics["bf16"] == metrics["fp32"]


def test_top_k_and_coverage_match_the_full_score_matrix(tmp_path):
    """top_k streams the catalogue in chunks: the same items as a topk over every item's score
    with each user's test input excluded; coverage@10 is the share of items anyone is shown."""
    from training.evaluate import beside, top_k

    rng = np.random.default_rng(0)
    hist = [rng.choice(np.arange(1, 41), size=int(rng.integers(2, 9)), replace=False).tolist() for _ in range(30)]
    t = pa.table(
        {
            "user_id": list(range(1, 31)),
            "history": [h[:-2] or [h[0]] for h in hist],
            "valid_target": [h[-2] for h in hist],
            "test_target": [h[-1] for h in hist],
        },
        schema=schema.EVAL_SCHEMA,
    )
    pq.write_table(t, tmp_path / "eval.parquet")
    cfg = EvalConfig(item_chunk=7, batch_size=8, num_negatives=5)
    d = EvalData(str(tmp_path / "eval.parquet"), num_items=40, max_len=6, cfg=cfg)
    torch.manual_seed(0)
    model = SeqRec(40, ModelConfig(dim=8, num_layers=1, num_heads=1, dropout=0.0, max_len=6)).eval()
    got = top_k(model, d, cfg, "test", 10)
    s = d.splits["test"]
    with torch.no_grad():
        scores = model.scores(model.last_hidden(s.values, s.offsets))
    for u in range(len(s.targets)):
        scores[u, s.values[s.offsets[u] : s.offsets[u + 1]] - 1] = float("-inf")
    want = scores.topk(10, dim=1).indices + 1
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
    extra = beside(model, d, cfg)
    assert extra["test/full/coverage@10"] == len(torch.unique(want)) / 40
    assert extra["baseline/popular/test/full/hr@1"] == evaluate(MostPopular(d), d, cfg)["test/full/hr@1"]
