"""The retrain gate's evaluation: champion and challenger scored by one function on one split.

`score` rebuilds a checkpoint's model for the NEW shard set (its item table mapped through
both sets' raw item ids; an item it never saw ranks last) and evaluates it with the
challenger's EvalConfig on the same users, targets and sampled negatives.

    python -m training.gate --shards S --challenger CKPT [--champion CKPT] --out J.json
"""

import argparse
import json
import os
import sys

import pyarrow.parquet as pq
import torch
from torch import nn

from dataprep.schema import ITEM_MAP
from training.model import SeqRec


class GateError(Exception):
    """A checkpoint cannot be scored on the shard set (its files or item map are gone)."""


class KnownItems(nn.Module):
    """A SeqRec whose unknown items (False in `known`, by dense id) score -inf."""

    known: torch.Tensor

    def __init__(self, model: SeqRec, known: torch.Tensor, max_len: int):
        super().__init__()
        self.model = model
        self.max_len = max_len
        self.register_buffer("known", known)  # [num_items + 1], index 0 = padding

    def last_hidden(self, values, offsets, timestamps=None):
        return self.model.last_hidden(values, offsets, timestamps=timestamps)

    def scores(self, h: torch.Tensor, items: torch.Tensor | None = None) -> torch.Tensor:
        s = self.model.scores(h, items)
        known = self.known[1:] if items is None else self.known[items]
        return s.masked_fill(~known, float("-inf"))

    def pair_scores(self, h: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.model.pair_scores(h, items).masked_fill(~self.known[items], float("-inf"))


def item_rows(old_shards: str, new_shards: str) -> tuple[torch.Tensor, torch.Tensor]:
    """For each dense id of `new_shards` (0..num_items), the row of the same raw item in the
    model trained on `old_shards` (0 when unknown) and whether it is known."""
    path = os.path.join(old_shards, ITEM_MAP)
    if not os.path.isfile(path):
        raise GateError(f"the item map {path} of the model's shard set is gone: its items cannot be matched")
    old = pq.read_table(path).to_pydict()
    new = pq.read_table(os.path.join(new_shards, ITEM_MAP)).to_pydict()
    row_of_raw = dict(zip(old["raw_id"], old["id"], strict=True))
    rows = torch.zeros(max(new["id"], default=0) + 1, dtype=torch.int64)
    for nid, raw in zip(new["id"], new["raw_id"], strict=True):
        rows[nid] = row_of_raw.get(raw, 0)
    return rows, rows > 0


def load_for(path: str, shards_path: str) -> KnownItems:
    """The checkpoint's model (its own model settings) over the items of `shards_path`."""
    from training import checkpoint
    from training.config import config_from_dict
    from training.data import ShardSet

    if not os.path.isdir(path):
        raise GateError(f"checkpoint {path} is gone")
    meta = checkpoint.read_meta(path)
    cfg = config_from_dict(meta["config"])
    shards = ShardSet(shards_path)
    rows, known = item_rows(meta.get("shards") or "", shards_path)
    state = dict(checkpoint.load(path)["model"])
    state["item_emb.weight"] = state["item_emb.weight"][rows] * known[:, None]  # unknown: a zero row
    torch.manual_seed(0)
    model = SeqRec(shards.num_items, cfg.model)
    model.load_state_dict(state)
    return KnownItems(model, known, cfg.model.max_len).eval()


def score(path: str, shards_path: str, eval_cfg, splits=("valid", "test")) -> dict[str, float]:
    """`training.evaluate.evaluate` of the checkpoint's model on the shard set's users."""
    from training.data import ShardSet
    from training.evaluate import EvalData, evaluate

    model = load_for(path, shards_path)
    shards = ShardSet(shards_path)
    data = EvalData(shards.eval_path, shards.num_items, model.max_len, eval_cfg)
    return evaluate(model, data, eval_cfg, splits=splits)


def split_identity(shards_path: str) -> dict[str, str]:
    """What identifies the test split: the manifest's input fingerprint and eval file's SHA-256,
    and its kind with a temporal split's cut and horizon in seconds ("" for leave-one-out)."""
    from training.data import ShardSet

    m = ShardSet(shards_path).manifest
    split = m.get("split") or {}
    return {
        "fingerprint": str(m.get("input", {}).get("fingerprint", "")),
        "eval_sha256": str(m.get("files", {}).get("eval.parquet", "")),
        "shards": shards_path,
        "kind": str(split.get("kind", "leave_one_out")),
        "cut": str(split.get("cut", "")),
        "horizon": str(split.get("horizon", "")),
    }


def judge(shards_path: str, challenger: str, champion: str | None) -> dict:
    """Both checkpoints scored on `shards_path` with the challenger's EvalConfig. The
    champion is scored on the test split only; when it cannot be scored, `champion_error` says why."""
    from training import checkpoint
    from training.config import config_from_dict

    if not os.path.isdir(challenger):
        raise GateError(
            f"challenger checkpoint {challenger} does not exist (a checkpoint folder OUT/checkpoints/step-N)"
        )
    eval_cfg = config_from_dict(checkpoint.read_meta(challenger)["config"]).eval
    out = {
        "split": split_identity(shards_path),
        "metrics": score(challenger, shards_path, eval_cfg),
        "champion": None,
        "champion_error": None,
    }
    if champion:
        try:
            out["champion"] = score(champion, shards_path, eval_cfg, splits=("test",))
        except Exception as e:  # a gone or foreign checkpoint: the verdict says so, nothing crashes
            out["champion_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:500]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.gate", description=__doc__.splitlines()[0])
    p.add_argument("--shards", required=True, help="the new shard set: its test split judges both")
    p.add_argument("--challenger", required=True, help="checkpoint of the newly trained model")
    p.add_argument("--champion", default="", help="checkpoint of the registry's champion (none: first model)")
    p.add_argument("--out", required=True, help="JSON result, written atomically")
    a = p.parse_args(argv)
    from ftcore.util.files import atomic_write_json
    from training.checkpoint import CheckpointError
    from training.data import DataError

    try:
        result = judge(a.shards, a.challenger, a.champion or None)
    except (GateError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    atomic_write_json(a.out, result, indent=1, sort_keys=True)
    print(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
