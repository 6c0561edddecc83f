"""Ranking metrics and both evaluation protocols against hand-computed cases."""

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dataprep import schema
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
