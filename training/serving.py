"""The run's model as an MLflow pyfunc anyone can serve: raw item ids in, top-k raw item ids out.

Logged under the run's "model", loadable without ftrec: program.pt2 (`Scorer` through
torch.export: dense histories [B, L] -> query vectors [B, d]; the pyfunc scores them against
the program's own item table in bounded chunks), item_ids.json (the item map), README.md and
ftrec_recommender_pyfunc.py. The dense `Scorer` exists because SeqRec.forward's jagged
indexing is data-dependent and does not export (docs/training.md).
"""

import json
import math
import os

import pyarrow.parquet as pq
import torch
from torch import nn

from dataprep.schema import ITEM_MAP, MANIFEST, has_timestamps

ARTIFACTS = {"program": "program.pt2", "item_ids": "item_ids.json", "readme": "README.md"}
ITEM_TABLE = "model.item_emb.weight"  # the exported program's item embeddings, read by the pyfunc
PYFUNC_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ftrec_recommender_pyfunc.py")


def timed(model, shards_path: str) -> bool:
    """Does the model read each item's time? HSTU with the time-gap bias, trained on a shard
    set with timestamps (see has_timestamps): then serving needs the same times evaluation had."""
    with open(os.path.join(shards_path, MANIFEST)) as f:
        has_time = has_timestamps(json.load(f).get("format_version", 1))
    return has_time and model.cfg.attention == "hstu" and model.cfg.rel_bias == "pos+time"


class Scorer(nn.Module):
    """SeqRec on a dense [B, L] batch: the embeddings and mask SeqRec.forward builds from a
    jagged batch (padded to this very layout), then the model's own encode, ln_out and scores,
    as training/evaluate.py calls them through last_hidden, with each item's time when the
    model is `timed`: the same scores as evaluation's path. With `query`, the vector those
    scores are taken from instead ([B, d], L2-normalized for cosine): scores = query @ table.T,
    table being the model's ITEM_TABLE (rows 1..num_items, normalized too for cosine)."""

    def __init__(self, model, timed: bool = False, query: bool = False):
        super().__init__()
        self.model, self.timed, self.query = model, timed, query

    def forward(self, items: torch.Tensor, timestamps: torch.Tensor | None = None) -> torch.Tensor:
        m = self.model
        B, L = items.shape
        valid = items != 0  # [B, L]
        lengths = valid.sum(1)
        pos = torch.arange(L, device=items.device)
        from_end = (lengths[:, None] - 1 - pos[None]).clamp(min=0)  # pads: any row, zeroed below
        x = (m.item_emb(items) * math.sqrt(m.cfg.dim) + m.pos_emb(from_end)) * valid[..., None]
        causal = torch.ones(L, L, dtype=torch.bool, device=items.device).tril()
        mask = causal[None] & valid[:, None, :]
        ts = timestamps * valid if self.timed and timestamps is not None else None  # pads 0, as forward pads
        x = m.encode(x, mask, ts)
        h = m.ln_out(x[torch.arange(B, device=items.device), lengths - 1])  # needs lengths >= 1
        return m._hidden_out(h) if self.query else m.scores(h)


def _readme(max_len: int, is_timed: bool) -> str:
    need = (
        "`timestamps` is REQUIRED: this HSTU model reads the time gaps between items (epoch seconds, "
        "one per history item, oldest first), as it was trained and evaluated."
        if is_timed
        else "`timestamps` is optional and ignored: this model reads item order only."
    )
    return (
        "# ftrec recommender (MLflow pyfunc)\n\n"
        "Input: a DataFrame with `history` (lists of raw item ids as strings, oldest first) and "
        "`timestamps` (lists of epoch seconds, one per history item).\n"
        f"{need}\n\nParams: k (default 10), exclude_history (default true). "
        f"The newest {max_len} known items of a history are the model's context; unknown ids are "
        "ignored with their times.\n\nOutput: `items` (top-k raw ids, best first) and `scores`.\n"
        "\nLimits (rows per request, raw ids per history, k): ftrec_recommender_pyfunc.py's docstring; "
        "a request over one is refused with the limit named.\n"
    )


def export(model, shards_path: str, folder: str) -> dict:
    """Write program.pt2, item_ids.json and README.md for `model` (an eval-mode SeqRec on the
    CPU) into `folder`; returns the artifacts and model_config that `log_pyfunc` logs."""
    items = pq.read_table(os.path.join(shards_path, ITEM_MAP)).sort_by("id")
    if items.column("id").to_pylist() != list(range(1, model.num_items + 1)):
        raise ValueError(f"{ITEM_MAP} of {shards_path} does not hold dense ids 1..{model.num_items}")
    return write(model, items.column("raw_id").to_pylist(), folder, timed(model, shards_path))


def write(model, raw_ids: list[str], folder: str, is_timed: bool = False) -> dict:
    """`export` given the raw id of each dense item (raw_ids[i] is dense item i + 1)."""
    os.makedirs(folder, exist_ok=True)
    max_len = model.cfg.max_len
    batch, length = torch.export.Dim("batch", min=1), torch.export.Dim("length", min=1, max=max_len)
    example = torch.ones(2, min(2, max_len), dtype=torch.int64)
    args: tuple[torch.Tensor, ...] = (example,)
    dims = {"items": {0: batch, 1: length}}
    if is_timed:
        args, dims = (example, example * 1_600_000_000), {**dims, "timestamps": {0: batch, 1: length}}
    with torch.no_grad():
        program = torch.export.export(Scorer(model, is_timed, query=True).eval(), args, dynamic_shapes=dims)
    torch.export.save(program, os.path.join(folder, "program.pt2"))
    with open(os.path.join(folder, "item_ids.json"), "w") as f:
        json.dump(raw_ids, f)
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write(_readme(max_len, is_timed))
    config = {"max_len": max_len, "timed": is_timed, "similarity": model.cfg.similarity, "item_table": ITEM_TABLE}
    return {
        "artifacts": {name: os.path.join(folder, file) for name, file in ARTIFACTS.items()},
        "model_config": config,
        "example": raw_ids[:3],
    }


def log_pyfunc(exported: dict, registered_model_name: str | None = None):
    """mlflow.pyfunc.log_model of an `export` under the active run, artifact name "model"."""
    import mlflow
    import pandas as pd
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema
    from mlflow.types.schema import Array

    is_timed = bool(exported["model_config"].get("timed"))
    example = pd.DataFrame(
        {"history": [exported["example"]], "timestamps": [[1_600_000_000] * len(exported["example"])]}
    )
    signature = ModelSignature(
        inputs=Schema(
            [
                ColSpec(Array(DataType.string), "history"),
                ColSpec(Array(DataType.long), "timestamps", required=is_timed),
            ]
        ),
        outputs=Schema([ColSpec(Array(DataType.string), "items"), ColSpec(Array(DataType.double), "scores")]),
        params=ParamSchema([ParamSpec("k", DataType.long, 10), ParamSpec("exclude_history", DataType.boolean, True)]),
    )
    return mlflow.pyfunc.log_model(
        name="model",
        python_model=PYFUNC_FILE,
        artifacts=exported["artifacts"],
        model_config=exported["model_config"],
        signature=signature,
        input_example=(example, {"k": 10}),
        metadata={
            "inputs": "history: raw item ids, oldest first; timestamps: epoch seconds per item"
            + (" (required)" if is_timed else " (optional, ignored)"),
            "timed": is_timed,
            "max_len": exported["model_config"]["max_len"],
        },
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}"],
        registered_model_name=registered_model_name,
    )
