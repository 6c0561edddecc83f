"""ftrec's recommender as an MLflow pyfunc ("model from code", logged by training/serving.py).

Self-contained: it imports nothing of ftrec, so it runs where only mlflow and torch are.
predict(DataFrame: `history`, lists of raw item ids, oldest first; `timestamps` when the
model is timed; params k=10, exclude_history=True) -> DataFrame: `items` (top-k raw ids)
and `scores` (descending). Unknown ids are ignored; a history keeps its newest max_len
known items; one with no known item gets empty lists.
"""

import json

import mlflow
import pandas as pd
import torch
from mlflow.pyfunc import PythonModel


class FtrecRecommender(PythonModel):
    def load_context(self, context):
        self.program = torch.export.load(context.artifacts["program"]).module()
        with open(context.artifacts["item_ids"]) as f:
            self.raw_ids = json.load(f)  # dense id i + 1 at index i
        self.dense = {raw: i + 1 for i, raw in enumerate(self.raw_ids)}
        self.max_len = int(context.model_config["max_len"])
        self.timed = bool(context.model_config.get("timed", False))

    def _known(self, model_input: pd.DataFrame) -> list[list[tuple[int, int]]]:
        """Per row, (dense id, epoch second) of its known items; 0 s when the model reads no time."""
        has_times = "timestamps" in model_input and not model_input["timestamps"].isna().all()
        if self.timed and not has_times:
            raise ValueError("this model reads item times: give `timestamps` (epoch seconds per history item)")
        rows = []
        for n, h in enumerate(model_input["history"]):
            ts = list(model_input["timestamps"].iloc[n]) if self.timed else [0] * len(h)
            if len(ts) != len(h):
                raise ValueError(f"row {n}: {len(h)} history items but {len(ts)} timestamps")
            rows.append([(self.dense[r], int(t)) for r, t in zip(map(str, h), ts, strict=True) if r in self.dense])
        return rows

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        params = params or {}
        k, exclude = int(params.get("k", 10)), bool(params.get("exclude_history", True))
        histories = self._known(model_input)
        rows = [i for i, h in enumerate(histories) if h]
        out: dict[str, list[list]] = {"items": [[] for _ in histories], "scores": [[] for _ in histories]}
        if rows and k > 0:
            recent = [histories[i][-self.max_len :] for i in rows]
            batch = torch.zeros(2, len(rows), max(map(len, recent)), dtype=torch.int64)  # right-padded
            for b, h in enumerate(recent):
                batch[:, b, : len(h)] = torch.tensor(h).T
            with torch.no_grad():
                scores = (self.program(batch[0], batch[1]) if self.timed else self.program(batch[0])).float()
            if exclude:
                for b, i in enumerate(rows):
                    scores[b, torch.tensor([d for d, _ in histories[i]]) - 1] = float("-inf")
            top = scores.topk(min(k, scores.shape[1]), dim=1)
            for b, i in enumerate(rows):
                keep = torch.isfinite(top.values[b])  # fewer than k items left after exclusion
                out["items"][i] = [self.raw_ids[j] for j in top.indices[b][keep].tolist()]
                out["scores"][i] = top.values[b][keep].tolist()
        return pd.DataFrame(out)


mlflow.models.set_model(FtrecRecommender())
