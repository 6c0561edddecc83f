"""Ranking metrics and both evaluation protocols against hand-computed cases."""

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataprep import schema
from training.config import EvalConfig
from training.evaluate import EvalData, MostPopular, evaluate, ranking_metrics


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
