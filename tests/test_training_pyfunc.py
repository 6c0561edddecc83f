"""The pyfunc's bounded scoring: chunks of rows and items give exactly the one-chunk answer.

A small random SeqRec goes through serving.write and is loaded as the pyfunc loads it (no
MLflow run); chunk sizes divide neither the rows nor the catalogue.
"""

import random
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from training import ftrec_recommender_pyfunc as pyfunc
from training.config import ModelConfig
from training.model import SeqRec
from training.serving import write

N_ITEMS = 103


def _load(folder, exported: dict, row_chunk: int, item_chunk: int) -> pyfunc.FtrecRecommender:
    rec = pyfunc.FtrecRecommender()
    rec.load_context(SimpleNamespace(artifacts=exported["artifacts"], model_config=exported["model_config"]))
    rec.row_chunk, rec.item_chunk = row_chunk, item_chunk
    return rec


@pytest.fixture(scope="module", params=["dot", "cosine"])
def served(request, tmp_path_factory):
    torch.manual_seed(0)
    model = SeqRec(N_ITEMS, ModelConfig(dim=16, num_heads=2, max_len=8, similarity=request.param)).eval()
    raw_ids = [f"r{7 * i + 3}" for i in range(N_ITEMS)]
    exported = write(model, raw_ids, str(tmp_path_factory.mktemp("pyfunc")))
    rng = random.Random(1)
    histories = [[rng.choice(raw_ids + ["unknown"]) for _ in range(rng.randint(0, 12))] for _ in range(37)]
    return model, raw_ids, exported, pd.DataFrame({"history": histories})


@pytest.mark.parametrize("k,exclude", [(10, True), (100, True), (7, False)])
def test_chunked_equals_one_chunk_and_seqrec(served, k, exclude):
    model, raw_ids, exported, frame = served
    params = {"k": k, "exclude_history": exclude}
    one = _load(None, exported, row_chunk=len(frame), item_chunk=N_ITEMS).predict(None, frame, params)
    chunked = _load(None, exported, row_chunk=5, item_chunk=7).predict(None, frame, params)
    assert chunked["items"].tolist() == one["items"].tolist()
    for a, b in zip(chunked["scores"], one["scores"], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)

    dense = {r: i + 1 for i, r in enumerate(raw_ids)}
    for hist, items, scores in zip(frame["history"], chunked["items"], chunked["scores"], strict=True):
        known = [dense[r] for r in hist if r in dense]
        if not known:
            assert items == [] and scores == []
            continue
        recent = torch.tensor(known[-model.cfg.max_len :])
        with torch.no_grad():
            s = model.scores(model.last_hidden(recent, torch.tensor([0, len(recent)])))[0]
        if exclude:
            s[torch.tensor(known) - 1] = float("-inf")
        top = s.topk(min(k, N_ITEMS))
        keep = torch.isfinite(top.values)
        assert items == [raw_ids[j] for j in top.indices[keep].tolist()]  # random scores: no ties
        assert scores == pytest.approx(top.values[keep].tolist(), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("chunk", [1, 7, 32, 200])
def test_running_top_breaks_ties_by_lower_column(chunk):
    torch.manual_seed(2)
    s = torch.randint(0, 4, (9, 61)).float()  # many ties at every cut
    s[0, :50] = float("-inf")  # fewer than k finite scores
    want_v, want_i = (-s).sort(dim=1, stable=True)
    blocks = ((lo, s[:, lo : lo + chunk]) for lo in range(0, s.shape[1], chunk))
    v, i = pyfunc.running_top(blocks, 20, s.shape[0])
    finite = torch.isfinite(want_v[:, :20])  # -inf (excluded) entries are dropped, in any order
    assert torch.equal(torch.isfinite(v), finite)
    assert torch.equal(i[finite], want_i[:, :20][finite]) and torch.equal(v[finite], -want_v[:, :20][finite])


def test_oversized_requests_are_refused(served):
    _, raw_ids, exported, frame = served
    rec = _load(None, exported, row_chunk=5, item_chunk=7)
    rec.max_rows, rec.max_history, rec.max_k = 3, 4, 50
    small = pd.DataFrame({"history": [raw_ids[:2]]})
    with pytest.raises(ValueError, match="4 rows: over MAX_ROWS=3.*split the request"):
        rec.predict(None, pd.DataFrame({"history": [raw_ids[:2]] * 4}))
    with pytest.raises(ValueError, match="row 1: 5 history items, over MAX_HISTORY=4.*newest"):
        rec.predict(None, pd.DataFrame({"history": [raw_ids[:2], raw_ids[:5]]}))
    with pytest.raises(ValueError, match="k=51: over MAX_K=50"):
        rec.predict(None, small, {"k": 51})
    assert len(rec.predict(None, small, {"k": 50})["items"][0]) == 50
