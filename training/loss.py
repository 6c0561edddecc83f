"""Next-item losses at every position, normalized by the GLOBAL count of target tokens.

Each rank divides the SUM of its per-token losses by the replica group's target count, so
with gradients summed the update is that of one big batch, however shards spread samples.
The full softmax over every item (loss.kind = "auto" up to SOFTMAX_MAX_ITEMS: the default),
sampled softmax with shared negatives (accidental hits masked) or each token's own
(loss.negatives), or BCE with one negative per token (the SASRec objective).
"""

import torch
import torch.nn.functional as F

from ftcore import collectives as coll
from training import distributed
from training.config import LossConfig

# loss.kind = "auto" scores every item up to this catalogue size: a step's logits are its tokens
# x items floats (Beauty's longest step, 6,400 tokens x 12,101 items: 310 MB, as much again for
# their gradient) and its cost tokens x items x dim; past it, sampled softmax scales to any size
SOFTMAX_MAX_ITEMS = 32768


def resolve_kind(cfg: LossConfig, num_items: int, sharded: bool = False) -> tuple[str, str]:
    """(the loss kind to train with, why): loss.kind itself, or what "auto" means here: the full
    softmax for a catalogue of at most SOFTMAX_MAX_ITEMS on a replicated item table, else
    sampled softmax. The full softmax reached the public state of the art on Beauty where sampled
    softmax stayed 5-10% below it (BENCHMARKS.md, "A recipe against the public state of the art")."""
    if cfg.kind != "auto":
        return cfg.kind, f"loss.kind={cfg.kind}"
    if sharded:
        return "sampled_softmax", "loss.kind=auto: sampled_softmax (a sharded item table)"
    if num_items > SOFTMAX_MAX_ITEMS:
        return "sampled_softmax", f"loss.kind=auto: sampled_softmax ({num_items} items > {SOFTMAX_MAX_ITEMS})"
    return "softmax", f"loss.kind=auto: softmax over all {num_items} items (at most {SOFTMAX_MAX_ITEMS})"


def negatives_per(cfg: LossConfig, num_items: int) -> tuple[int, int]:
    """(negatives per target token, negatives per step) that `draw_negatives` draws (softmax:
    every item, every step)."""
    if cfg.kind == "bce":
        return 1, 0
    if resolve_kind(cfg, num_items)[0] == "softmax":
        return 0, num_items
    return (cfg.num_negatives, 0) if cfg.negatives == "per_token" else (0, cfg.num_negatives)


def draw_negatives(
    num_items: int, cfg: LossConfig, labels: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """The step's negatives, drawn on the CPU generator (its state is checkpointed; None: torch's default).

    Drawn before the forward pass, so a sharded item table can fetch their rows while the
    transformer runs: shared ones for sampled softmax, one per token for BCE."""
    kind = resolve_kind(cfg, num_items)[0]
    if kind == "bce":
        shape = tuple(labels.shape)
    elif kind == "softmax":
        shape = (0,)  # every item is a negative
    elif cfg.negatives == "per_token":
        shape = (*labels.shape, cfg.num_negatives)
    else:
        shape = (cfg.num_negatives,)
    return torch.randint(1, num_items + 1, shape, generator=generator).to(labels.device)


def sampled_softmax_sum(
    model, h: torch.Tensor, labels: torch.Tensor, cfg: LossConfig, negatives: torch.Tensor
) -> torch.Tensor:
    """Sum over tokens of -log softmax(target | target + negatives): `negatives` [K] shared by
    every token, or [N, K] each token's own."""
    pos = model.pair_scores(h, labels) / cfg.temperature  # [N]
    if negatives.dim() == 1:
        neg = model.scores(h, negatives) / cfg.temperature  # [N, K]
        hit = negatives[None, :] == labels[:, None]
    else:
        neg = model.token_scores(h, negatives) / cfg.temperature
        hit = negatives == labels[:, None]
    neg = neg.masked_fill(hit, float("-inf"))  # an accidental hit is not a negative
    logits = torch.cat([pos[:, None], neg], dim=1)
    return (torch.logsumexp(logits, dim=1) - pos).sum()


def softmax_sum(model, h: torch.Tensor, labels: torch.Tensor, cfg: LossConfig, negatives: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of -log softmax(target | every item): the full catalogue's cross-entropy."""
    return F.cross_entropy(model.scores(h) / cfg.temperature, labels - 1, reduction="sum")


def bce_sum(model, h: torch.Tensor, labels: torch.Tensor, cfg: LossConfig, negatives: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of -log sigmoid(target) - log sigmoid(-negative), one negative each."""
    pos = model.pair_scores(h, labels) / cfg.temperature
    neg = model.pair_scores(h, negatives) / cfg.temperature
    neg_term = F.logsigmoid(-neg) * (negatives != labels)  # a drawn positive is not a negative
    return -(F.logsigmoid(pos) + neg_term).sum()


LOSSES = {"sampled_softmax": sampled_softmax_sum, "softmax": softmax_sum, "bce": bce_sum}


def loss_sum(
    model, h, labels, cfg: LossConfig, generator: torch.Generator | None = None, negatives: torch.Tensor | None = None
) -> torch.Tensor:
    """The loss SUM of the step; `negatives` drawn by `draw_negatives`, or drawn here."""
    if negatives is None:
        negatives = draw_negatives(model.num_items, cfg, labels, generator)
    return LOSSES[resolve_kind(cfg, model.num_items)[0]](model, h, labels, cfg, negatives)


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
