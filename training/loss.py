"""Next-item losses at every position, normalized by the GLOBAL count of target tokens.

Each rank divides the SUM of its per-token losses by the replica group's target count, so
with gradients summed the update is that of one big batch, however shards spread samples.
Sampled softmax with shared negatives (accidental hits masked; the default) or BCE with one
negative per token (the SASRec objective).
"""

import torch
import torch.nn.functional as F

from ftcore import collectives as coll
from training import distributed
from training.config import LossConfig


def draw_negatives(
    num_items: int, cfg: LossConfig, labels: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """The step's negatives, drawn on the CPU generator (its state is checkpointed; None: torch's default).

    Drawn before the forward pass, so a sharded item table can fetch their rows while the
    transformer runs: shared ones for sampled softmax, one per token for BCE."""
    shape = (cfg.num_negatives,) if cfg.kind == "sampled_softmax" else tuple(labels.shape)
    return torch.randint(1, num_items + 1, shape, generator=generator).to(labels.device)


def sampled_softmax_sum(
    model, h: torch.Tensor, labels: torch.Tensor, cfg: LossConfig, negatives: torch.Tensor
) -> torch.Tensor:
    """Sum over tokens of -log softmax(target | target + shared negatives)."""
    pos = model.pair_scores(h, labels) / cfg.temperature  # [N]
    neg = model.scores(h, negatives) / cfg.temperature  # [N, K]
    neg = neg.masked_fill(negatives[None, :] == labels[:, None], float("-inf"))
    logits = torch.cat([pos[:, None], neg], dim=1)
    return (torch.logsumexp(logits, dim=1) - pos).sum()


def bce_sum(model, h: torch.Tensor, labels: torch.Tensor, cfg: LossConfig, negatives: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of -log sigmoid(target) - log sigmoid(-negative), one negative each."""
    pos = model.pair_scores(h, labels) / cfg.temperature
    neg = model.pair_scores(h, negatives) / cfg.temperature
    neg_term = F.logsigmoid(-neg) * (negatives != labels)  # a drawn positive is not a negative
    return -(F.logsigmoid(pos) + neg_term).sum()


LOSSES = {"sampled_softmax": sampled_softmax_sum, "bce": bce_sum}


def loss_sum(
    model, h, labels, cfg: LossConfig, generator: torch.Generator | None = None, negatives: torch.Tensor | None = None
) -> torch.Tensor:
    """The loss SUM of the step; `negatives` drawn by `draw_negatives`, or drawn here."""
    if negatives is None:
        negatives = draw_negatives(model.num_items, cfg, labels, generator)
    return LOSSES[cfg.kind](model, h, labels, cfg, negatives)


def start_global_counts(counts: list[float]) -> tuple[torch.Tensor, object]:
    """Start all-reducing this rank's counts (target tokens first) within the replica group.

    They are known before the forward pass, so the collective overlaps the forward;
    call `.wait()` on the returned work (None in a single process) before dividing.
    """
    total = torch.tensor(counts, dtype=torch.float64)  # counts: control values, read by the host
    if distributed.active():
        # the default group = this replica group
        return total, coll.all_reduce(total, kind=coll.CONTROL, async_op=True)
    return total, None
