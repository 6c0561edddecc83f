"""ftrec's recommender as an MLflow pyfunc ("model from code", logged by training/serving.py).

Self-contained: it imports nothing of ftrec, so it runs where only mlflow and torch are.
predict(DataFrame: `history`, lists of raw item ids, oldest first; `timestamps` when the
model is timed; params k=10, exclude_history=True) -> DataFrame: `items` (top-k raw ids)
and `scores` (descending; equal scores rank the lower dense id first). Unknown ids are
ignored; a history keeps its newest max_len known items; one with no known item gets empty lists.

Bounded memory: the program (histories -> query vectors) runs on at most ROW_CHUNK rows at a
time, and those rows are scored against ITEM_CHUNK items at a time with a running top k per
row, so at most ROW_CHUNK x ITEM_CHUNK float32 scores are live at once, whatever the
catalogue's size: 256 x 65,536 = 64 MB by default (plus the program's activations for
ROW_CHUNK histories and per-row top-k buffers).
Requests over a limit are refused with a ValueError naming it: more than MAX_ROWS rows, a
history longer than MAX_HISTORY raw ids, k above MAX_K. Each is an environment variable
(FTREC_SERVE_<NAME>, read when the model loads) with the default below.
"""

import json
import os

import mlflow
import pandas as pd
import torch
import torch.nn.functional as F
from mlflow.pyfunc import PythonModel

ROW_CHUNK = 256  # rows per program call and per score block
ITEM_CHUNK = 65_536  # items per score block
MAX_ROWS = 10_000  # rows per request
MAX_HISTORY = 10_000  # raw ids per history (only the newest max_len known ones are read)
MAX_K = 1_000  # recommendations per row


def _setting(name: str, default: int) -> int:
    return int(os.environ.get(f"FTREC_SERVE_{name}", default))


def _chunk_top(s: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k of each row of s by (score descending, column ascending), exact under ties."""
    v, i = s.topk(min(k + 1, s.shape[1]), dim=1)
    # when the k+1-th ties the k-th, topk took any of the columns tied at the cut: take the
    # lowest (ties at -inf, excluded items, are dropped in the end)
    over = torch.zeros(len(s), dtype=torch.bool)
    if v.shape[1] > k:
        over = (v[:, k - 1] == v[:, k]) & torch.isfinite(v[:, k])
    v, i = v[:, :k], i[:, :k]
    cut = v[:, -1:]
    for r in over.nonzero().flatten().tolist():
        above = (s[r] > cut[r]).nonzero().flatten()
        i[r] = torch.cat([above, (s[r] == cut[r]).nonzero().flatten()[: k - len(above)]])
        v[r] = s[r, i[r]]
    i, order = i.sort(dim=1)
    v, order = v.gather(1, order).sort(dim=1, descending=True, stable=True)
    return v, i.gather(1, order)


def running_top(blocks, k: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k by (score descending, column ascending) of a [rows, N] matrix given as blocks
    (first column, [rows, n] scores) in column order: scores [rows, k] and columns [rows, k]."""
    best = torch.empty(rows, 0), torch.empty(rows, 0, dtype=torch.int64)
    for lo, s in blocks:
        v, i = _chunk_top(s, min(k, s.shape[1]))
        best = _merge(best, (v, i + lo), k)
    return best


def _merge(best: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor], k: int):
    """Running top k and a later chunk's top k -> top k; both sorted, `new`'s ids all larger."""
    v, order = torch.cat([best[0], new[0]], 1).sort(dim=1, descending=True, stable=True)
    return v[:, :k], torch.cat([best[1], new[1]], 1).gather(1, order[:, :k])


class FtrecRecommender(PythonModel):
    def load_context(self, context):
        self.program = torch.export.load(context.artifacts["program"]).module()
        with open(context.artifacts["item_ids"]) as f:
            self.raw_ids = json.load(f)  # dense id i + 1 at index i
        self.dense = {raw: i + 1 for i, raw in enumerate(self.raw_ids)}
        cfg = context.model_config
        self.max_len = int(cfg["max_len"])
        self.timed = bool(cfg.get("timed", False))
        self.cosine = cfg.get("similarity", "dot") == "cosine"
        self.table = self.program.state_dict()[cfg["item_table"]][1:]  # a view: row j is dense item j + 1
        self.row_chunk, self.item_chunk = _setting("ROW_CHUNK", ROW_CHUNK), _setting("ITEM_CHUNK", ITEM_CHUNK)
        self.max_rows, self.max_history = _setting("MAX_ROWS", MAX_ROWS), _setting("MAX_HISTORY", MAX_HISTORY)
        self.max_k = _setting("MAX_K", MAX_K)

    def _check(self, model_input: pd.DataFrame, k: int) -> None:
        """Refuse a request over a limit, saying which and what to do."""
        if len(model_input) > self.max_rows:
            raise ValueError(
                f"{len(model_input)} rows: over MAX_ROWS={self.max_rows} rows per request; split the "
                "request (or raise FTREC_SERVE_MAX_ROWS where the model is served)"
            )
        for n, h in enumerate(model_input["history"]):
            if len(h) > self.max_history:
                raise ValueError(
                    f"row {n}: {len(h)} history items, over MAX_HISTORY={self.max_history}; send the newest "
                    f"ones (the model reads the newest {self.max_len} known items) or raise FTREC_SERVE_MAX_HISTORY"
                )
        if k > self.max_k:
            raise ValueError(f"k={k}: over MAX_K={self.max_k}; ask for fewer (or raise FTREC_SERVE_MAX_K)")

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

    def _query(self, histories: list[list[tuple[int, int]]]) -> torch.Tensor:
        """Non-empty histories -> the program's query vectors [R, d]."""
        recent = [h[-self.max_len :] for h in histories]
        batch = torch.zeros(2, len(recent), max(map(len, recent)), dtype=torch.int64)  # right-padded
        for b, h in enumerate(recent):
            batch[:, b, : len(h)] = torch.tensor(h).T
        with torch.no_grad():
            return (self.program(batch[0], batch[1]) if self.timed else self.program(batch[0])).float()

    def _top(self, histories: list[list[tuple[int, int]]], k: int, exclude: bool):
        """Top k (scores [R, k], dense ids - 1 [R, k]) of non-empty histories, ITEM_CHUNK items at a time."""
        q = self._query(histories)
        seen = [(b, d - 1) for b, h in enumerate(histories) for d, _ in h] if exclude else []
        seen_r, seen_c = torch.tensor(seen, dtype=torch.int64).reshape(-1, 2).T

        def blocks():
            for lo in range(0, len(self.table), self.item_chunk):
                e = self.table[lo : lo + self.item_chunk].float()
                s = q @ (F.normalize(e, dim=-1) if self.cosine else e).T
                here = (seen_c >= lo) & (seen_c < lo + len(e))
                s[seen_r[here], seen_c[here] - lo] = float("-inf")
                yield lo, s

        with torch.no_grad():
            return running_top(blocks(), k, len(histories))

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        params = params or {}
        k, exclude = int(params.get("k", 10)), bool(params.get("exclude_history", True))
        self._check(model_input, k)
        histories = self._known(model_input)
        rows = [i for i, h in enumerate(histories) if h]
        out: dict[str, list[list]] = {"items": [[] for _ in histories], "scores": [[] for _ in histories]}
        if k <= 0:
            return pd.DataFrame(out)
        for lo in range(0, len(rows), self.row_chunk):
            part = rows[lo : lo + self.row_chunk]
            values, ids = self._top([histories[i] for i in part], k, exclude)
            for b, i in enumerate(part):
                keep = torch.isfinite(values[b])  # fewer than k items left after exclusion
                out["items"][i] = [self.raw_ids[j] for j in ids[b][keep].tolist()]
                out["scores"][i] = values[b][keep].tolist()
        return pd.DataFrame(out)


mlflow.models.set_model(FtrecRecommender())
