"""`TrainState`: everything a step changes, behind one state_dict / load_state_dict.

Checkpoints save it and ftcore's catch-up ships it to a recovering replica group:
model, optimizer, LR scheduler, committed step, data cursor and the RNG states
(the global torch generator, used by dropout, and the negative sampler's own
generator). Loading it makes the next step bitwise identical to an uninterrupted run.

Also builds the optimizer and schedule:
- AdamW for dense parameters;
- plain (dense) Adam on the item table, as its own param group with its own lr and no
  weight decay. Why not SparseAdam: the table is tied to the output side, so each step
  touches the targets and every shared negative, and its gradient travels in the same
  flat all-reduce as the dense ones (intra-group and ftcore's cross-group FTAR) instead
  of a second sparse path. At 10^4-10^5 rows x 64 the dense update costs well under a
  millisecond. Tables too large for that are FreeScale-comm's sharded embeddings.
- linear warmup, then cosine (or linear) decay to `min_lr_ratio`, or constant.
"""

import math

import torch

from training.config import OptimConfig
from training.data import DataCursor
from training.model import SeqRec


def build_optimizer(model: SeqRec, cfg: OptimConfig) -> torch.optim.Optimizer:
    table = [model.item_emb.weight]
    dense = [p for n, p in model.named_parameters() if n != "item_emb.weight"]
    beta1, beta2 = cfg.betas
    return torch.optim.AdamW(
        [
            {"params": dense, "lr": cfg.lr, "weight_decay": cfg.weight_decay, "name": "dense"},
            {"params": table, "lr": cfg.embedding_lr, "weight_decay": 0.0, "name": "embedding"},
        ],
        betas=(beta1, beta2),
    )


class WarmupDecay:
    """lr multiplier at step s: linear warmup, then decay to min_lr_ratio at total_steps."""

    def __init__(self, cfg: OptimConfig, total_steps: int):
        # warmup is capped at a tenth of the run so that short runs still reach their lr
        self.total = max(total_steps, 1)
        self.warmup = max(min(cfg.warmup_steps, self.total // 10), 0)
        self.kind, self.floor = cfg.decay, cfg.min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        t = min((step - self.warmup) / max(self.total - self.warmup, 1), 1.0)
        shape = 0.5 * (1 + math.cos(math.pi * t)) if self.kind == "cosine" else 1 - t
        return self.floor + (1 - self.floor) * shape


class TrainState:
    """The mutable state of training, one object for checkpoints and for catch-up."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        cursor: DataCursor,
        generator: torch.Generator,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.cursor, self.generator = cursor, generator
        self.step = 0  # committed steps

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "cursor": self.cursor.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "negatives": self.generator.get_state()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.cursor.load_state_dict(state["cursor"])
        torch.set_rng_state(state["rng"]["torch"])
        self.generator.set_state(state["rng"]["negatives"])
        self.step = int(state["step"])
