"""The run's model as an MLflow pyfunc anyone can serve: raw item ids in, top-k raw item ids out.

What is logged under the run's "model" (all of it loads without ftrec):
- program.pt2: `Scorer` through torch.export: a self-contained torch program, dense item
  histories [B, L] (oldest first, right-padded with 0, L <= max_len, B and L dynamic) ->
  scores [B, num_items] for the next item (column j is dense item j + 1);
- item_ids.json: the shard set's item map (dataprep/schema.py ITEM_MAP), raw id of dense
  item i at index i - 1;
- ftrec_recommender_pyfunc.py: the pyfunc ("model from code") that maps raw ids, pads,
  masks the history and takes the top k.

Why this shape: torch.export of SeqRec.forward itself fails (GuardOnDataDependentSymNode:
its jagged index reads int(offsets[-1]) and the longest length from the data), and
torch.jit.trace would bake one batch's lengths into the graph (TorchScript is deprecated
anyway). The dense `Scorer` has no data-dependent shape and exports with dynamic batch and
length. Why not mlflow.pytorch: its pickle needs ftrec's `training` package to load and
its forward takes (values, offsets), not raw ids.
"""

import json
import math
import os

import pyarrow.parquet as pq
import torch
from torch import nn

from dataprep.schema import ITEM_MAP

PYFUNC_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ftrec_recommender_pyfunc.py")


class Scorer(nn.Module):
    """SeqRec on a dense [B, L] batch: the same embeddings, mask and blocks as SeqRec.forward
    (which pads a jagged batch to this very layout), then scores of the newest position.
    tests/test_training_serving.py checks that both give the same scores. Item ids only: a
    model trained on timestamps is served as SeqRec runs without them."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        m = self.model
        B, L = items.shape
        valid = items != 0  # [B, L]
        lengths = valid.sum(1)
        pos = torch.arange(L, device=items.device)
        from_end = (lengths[:, None] - 1 - pos[None]).clamp(min=0)  # pads: any row, zeroed below
        x = (m.item_emb(items) * math.sqrt(m.cfg.dim) + m.pos_emb(from_end)) * valid[..., None]
        causal = torch.ones(L, L, dtype=torch.bool, device=items.device).tril()
        mask = causal[None] & valid[:, None, :]
        x = m.encode(x, mask)  # no timestamps: HSTU's time-gap bias is not served (positions only)
        h = m.ln_out(x[torch.arange(B, device=items.device), lengths - 1])  # needs lengths >= 1
        return m.scores(h)


def export(model, shards_path: str, folder: str) -> dict:
    """Write program.pt2 and item_ids.json for `model` (an eval-mode SeqRec on the CPU) into
    `folder`; returns the artifacts and model_config that `log_pyfunc` logs."""
    os.makedirs(folder, exist_ok=True)
    max_len = model.cfg.max_len
    batch, length = torch.export.Dim("batch", min=1), torch.export.Dim("length", min=1, max=max_len)
    example = torch.ones(2, min(2, max_len), dtype=torch.int64)
    with torch.no_grad():
        program = torch.export.export(Scorer(model).eval(), (example,), dynamic_shapes={"items": {0: batch, 1: length}})
    torch.export.save(program, os.path.join(folder, "program.pt2"))
    items = pq.read_table(os.path.join(shards_path, ITEM_MAP)).sort_by("id")
    if items.column("id").to_pylist() != list(range(1, model.num_items + 1)):
        raise ValueError(f"{ITEM_MAP} of {shards_path} does not hold dense ids 1..{model.num_items}")
    raw_ids = items.column("raw_id").to_pylist()
    with open(os.path.join(folder, "item_ids.json"), "w") as f:
        json.dump(raw_ids, f)
    return {
        "artifacts": {
            "program": os.path.join(folder, "program.pt2"),
            "item_ids": os.path.join(folder, "item_ids.json"),
        },
        "model_config": {"max_len": max_len},
        "example": raw_ids[:3],
    }


def log_pyfunc(exported: dict, registered_model_name: str | None = None):
    """mlflow.pyfunc.log_model of an `export` under the active run, artifact name "model"."""
    import mlflow
    import pandas as pd
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema
    from mlflow.types.schema import Array

    signature = ModelSignature(
        inputs=Schema([ColSpec(Array(DataType.string), "history")]),
        outputs=Schema([ColSpec(Array(DataType.string), "items"), ColSpec(Array(DataType.double), "scores")]),
        params=ParamSchema([ParamSpec("k", DataType.long, 10), ParamSpec("exclude_history", DataType.boolean, True)]),
    )
    return mlflow.pyfunc.log_model(
        name="model",
        python_model=PYFUNC_FILE,
        artifacts=exported["artifacts"],
        model_config=exported["model_config"],
        signature=signature,
        input_example=(pd.DataFrame({"history": [exported["example"]]}), {"k": 10}),
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}"],
        registered_model_name=registered_model_name,
    )
