"""Leave-one-out evaluation: HR@K, NDCG@K and MRR under two protocols.

valid: the training sequence -> valid_target; test: that plus valid_target -> test_target.
full: ranked against every item (eval.exclude_history drops the history, never the target);
sampled: against 100 uniform items the user never touched (the SASRec paper's protocol).
Ties count against the target, so a model that scores everything equal ranks worst.
The counting is training/ranking.py's (eval.precision: float32, or bf16 with the same ranks).
"""

import itertools
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq
import torch

from training.config import EvalConfig
from training.ranking import make_ranker


def ranking_metrics(ranks: np.ndarray, ks: tuple[int, ...]) -> dict[str, float]:
    """0-based ranks of the targets -> HR@k (all ks), NDCG@k (ks > 1) and MRR."""
    ranks = np.asarray(ranks, dtype=np.float64)
    out = {}
    for k in ks:
        hit = ranks < k
        out[f"hr@{k}"] = float(hit.mean())
        if k > 1:
            out[f"ndcg@{k}"] = float((hit / np.log2(ranks + 2)).mean())
    out["mrr"] = float((1.0 / (ranks + 1)).mean())
    return out


@dataclass
class Split:
    values: torch.Tensor  # inputs, jagged, users sorted by input length
    offsets: torch.Tensor
    targets: torch.Tensor  # [U]
    negatives: torch.Tensor  # [U, num_negatives] sampled protocol candidates
    timestamps: torch.Tensor | None = None  # like values: each input item's epoch second


class EvalData:
    """The evaluation users of a shard set, with inputs and fixed sampled negatives."""

    def __init__(self, eval_path: str, num_items: int, max_len: int, cfg: EvalConfig, sample: int = 0):
        """`sample` > 0: a fixed sample of that many users (seeded by eval.seed), in table order."""
        t = pq.read_table(eval_path)
        if 0 < sample < len(t):
            t = t.take(np.sort(np.random.default_rng(cfg.seed + 1).choice(len(t), sample, replace=False)))
        hist = t.column("history").combine_chunks()
        self.num_users, self.num_items = len(t), num_items
        lengths = hist.value_lengths().to_numpy().astype(np.int64)
        flat = hist.flatten().to_numpy().astype(np.int64)
        starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        valid_t = t.column("valid_target").to_numpy().astype(np.int64)
        test_t = t.column("test_target").to_numpy().astype(np.int64)
        # Every item each user touched, as sorted keys user*(I+1)+item: vectorized membership.
        users = np.repeat(np.arange(self.num_users), lengths)
        stride = num_items + 1
        seen = np.concatenate(
            [
                users * stride + flat,
                np.arange(self.num_users) * stride + valid_t,
                np.arange(self.num_users) * stride + test_t,
            ]
        )
        self._seen = np.unique(seen)
        self.history_items = flat
        rng = np.random.default_rng(cfg.seed)
        self.splits = {
            "valid": self._split(flat, starts, None, valid_t, max_len, rng, cfg.num_negatives),
            "test": self._split(flat, starts, valid_t, test_t, max_len, rng, cfg.num_negatives),
        }
        if "history_timestamps" in t.column_names:  # the same inputs' times, gathered the same way
            ts = t.column("history_timestamps").combine_chunks().flatten().to_numpy().astype(np.int64)
            valid_ts = t.column("valid_timestamp").to_numpy().astype(np.int64)
            for name, extra in (("valid", None), ("test", valid_ts)):
                self.splits[name].timestamps = torch.from_numpy(self._inputs(ts, starts, extra, max_len)[0])

    def _inputs(self, flat, starts, extra, max_len):
        """The most recent max_len items of each input (history, + `extra` after it), users
        sorted by input length: (values, offsets, order)."""
        lengths = np.diff(starts) + (0 if extra is None else 1)
        if extra is not None:  # append the valid target after each history
            ends = starts[1:]
            flat = np.insert(flat, ends, extra)
            starts = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=starts[1:])
        keep = np.minimum(lengths, max_len)  # most recent max_len items
        order = np.argsort(keep, kind="stable")
        keep, first = keep[order], starts[1:][order] - keep[order]
        offsets = np.zeros(len(keep) + 1, dtype=np.int64)
        np.cumsum(keep, out=offsets[1:])
        idx = np.repeat(first - offsets[:-1], keep) + np.arange(offsets[-1])
        return flat[idx], offsets, order

    def _split(self, flat, starts, extra, targets, max_len, rng, num_neg) -> Split:
        values, offsets, users = self._inputs(flat, starts, extra, max_len)
        negatives = self._negatives(users, rng, num_neg)
        return Split(
            torch.from_numpy(values),
            torch.from_numpy(offsets),
            torch.from_numpy(targets[users]),
            torch.from_numpy(negatives),
        )

    def _negatives(self, users: np.ndarray, rng, num_neg: int) -> np.ndarray:
        stride = self.num_items + 1
        neg = rng.integers(1, self.num_items + 1, size=(len(users), num_neg))
        for _ in range(1000):  # redraw the few that hit an item the user interacted with
            bad = np.isin(users[:, None] * stride + neg, self._seen)
            if not bad.any():
                return neg
            neg[bad] = rng.integers(1, self.num_items + 1, size=int(bad.sum()))
        raise RuntimeError("could not draw negatives: users interacted with almost every item")


@torch.no_grad()
def evaluate(model, data: EvalData, cfg: EvalConfig, splits=("valid", "test")) -> dict[str, float]:
    """Metrics named `<split>/<protocol>/<metric>`, e.g. test/full/ndcg@10."""
    was_training = model.training
    model.eval()
    dev = next(itertools.chain(model.parameters(), model.buffers())).device
    ranker = make_ranker(model, data.num_items, cfg.item_chunk, cfg.precision, dev)
    out: dict[str, float] = {}
    for name in splits:
        s = data.splits[name]
        full_ranks, sampled_ranks = [], []
        n = len(s.targets)
        for lo in range(0, n, cfg.batch_size):
            hi = min(lo + cfg.batch_size, n)
            a, b = int(s.offsets[lo]), int(s.offsets[hi])
            offsets = (s.offsets[lo : hi + 1] - a).to(dev)
            values = s.values[a:b].to(dev)
            ts = s.timestamps[a:b].to(dev) if s.timestamps is not None else None
            h = model.last_hidden(values, offsets, timestamps=ts)
            target, negatives = s.targets[lo:hi].to(dev), s.negatives[lo:hi].to(dev)
            rows = torch.repeat_interleave(torch.arange(hi - lo, device=dev), offsets[1:] - offsets[:-1])
            history = (rows, values) if cfg.exclude_history else None
            full, sampled = ranker.rank(h, target, negatives, history)
            full_ranks.append(full.cpu().numpy())
            sampled_ranks.append(sampled.cpu().numpy())
        for proto, ranks in (("full", full_ranks), ("sampled", sampled_ranks)):
            for k, v in ranking_metrics(np.concatenate(ranks), tuple(cfg.ks)).items():
                out[f"{name}/{proto}/{k}"] = v
    model.train(was_training)
    return out


@torch.no_grad()
def top_k(model, data: "EvalData", cfg: EvalConfig, split: str = "test", k: int = 10) -> torch.Tensor:
    """[users, k] each user's k best-scored items of the full catalogue (history excluded with
    eval.exclude_history, as the full ranking does), streamed in chunks of eval.item_chunk."""
    was_training = model.training
    model.eval()
    dev = next(itertools.chain(model.parameters(), model.buffers())).device
    s, out = data.splits[split], []
    for lo in range(0, len(s.targets), cfg.batch_size):
        hi = min(lo + cfg.batch_size, len(s.targets))
        a, b = int(s.offsets[lo]), int(s.offsets[hi])
        offsets, values = (s.offsets[lo : hi + 1] - a).to(dev), s.values[a:b].to(dev)
        ts = s.timestamps[a:b].to(dev) if s.timestamps is not None else None
        h = model.last_hidden(values, offsets, timestamps=ts)
        rows = torch.repeat_interleave(torch.arange(hi - lo, device=dev), offsets[1:] - offsets[:-1])
        best_v = h.new_full((hi - lo, 0), float("-inf"))
        best_i = torch.zeros(hi - lo, 0, dtype=torch.int64, device=dev)
        for c in range(1, data.num_items + 1, cfg.item_chunk):
            items = torch.arange(c, min(c + cfg.item_chunk, data.num_items + 1), device=dev)
            sc = model.scores(h, items).to(h.dtype)
            if cfg.exclude_history:
                inside = (values >= c) & (values < c + len(items))
                sc[rows[inside], values[inside] - c] = float("-inf")
            best_v, pick = torch.cat([best_v, sc], 1).topk(min(k, best_v.shape[1] + len(items)), dim=1)
            best_i = torch.cat([best_i, items.expand(hi - lo, -1)], 1).gather(1, pick)
        out.append(best_i.cpu())
    model.train(was_training)
    return torch.cat(out)


def beside(model, data: "EvalData", cfg: EvalConfig) -> dict[str, float]:
    """What a user reads the model's metrics beside: catalogue coverage@10 of its test
    recommendations (the share of items in anyone's top 10) and the most-popular baseline's
    test metrics on the same users (`baseline/popular/test/...`), so the lift shows."""
    shown = top_k(model, data, cfg, "test", 10)
    out = {"test/full/coverage@10": float(len(torch.unique(shown))) / data.num_items}
    popular = evaluate(MostPopular(data), data, cfg, splits=("test",))
    return out | {f"baseline/popular/{k}": v for k, v in popular.items()}


def evaluate_checkpoint(path: str, shards_path: str, overrides: list[str] | None = None) -> dict[str, float]:
    """`python -m training eval`: the checkpoint's model on the shard set's valid and test users."""
    from training import checkpoint
    from training.config import apply_overrides, config_from_dict, validate
    from training.data import DataError, ShardSet
    from training.model import SeqRec

    meta = checkpoint.read_meta(path)
    state = checkpoint.load(path)
    cfg = validate(apply_overrides(config_from_dict(meta["config"]), overrides or []))
    shards = ShardSet(shards_path)
    if shards.num_items != int(meta["num_items"]):
        raise DataError(
            f"checkpoint {path} was trained with {meta['num_items']} items, shard set {shards_path} "
            f"has {shards.num_items}: evaluate on the shard set it was trained on"
        )
    torch.manual_seed(0)
    model = SeqRec(shards.num_items, cfg.model)
    model.load_state_dict(state["model"])
    data = EvalData(shards.eval_path, shards.num_items, cfg.model.max_len, cfg.eval)
    return evaluate(model, data, cfg.eval) | (beside(model, data, cfg.eval) if cfg.eval.baseline else {})


class MostPopular(torch.nn.Module):
    """The most-popular baseline: every user gets items ranked by training-part counts.

    Counts come from the eval users' training sequences only (no valid/test targets):
    the floor any trained model must beat.
    """

    counts: torch.Tensor  # a buffer: per item, its count; index 0 is padding

    def __init__(self, data: "EvalData"):
        super().__init__()
        self.register_buffer(
            "counts", torch.bincount(torch.from_numpy(data.history_items), minlength=data.num_items + 1).double()
        )

    def last_hidden(self, values: torch.Tensor, offsets: torch.Tensor, timestamps=None) -> torch.Tensor:
        return torch.zeros(len(offsets) - 1, 1, dtype=torch.float64)

    def scores(self, h: torch.Tensor, items: torch.Tensor | None = None) -> torch.Tensor:
        c = self.counts[1:] if items is None else self.counts[items]
        return c.expand(h.shape[0], -1).clone()
