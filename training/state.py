"""`TrainState`: everything a step changes, behind one state_dict / load_state_dict.

Model, optimizer, scheduler, committed step, data cursor, both RNG states and the model
selection's record (training/selection.py, when eval.best_metric or eval.patience is on): what a
checkpoint saves and a recovering group receives; loading it makes the next step bitwise
identical. Also the optimizer (AdamW; the item table in its own group: dense "adam" or
`RowwiseAdamW` on the touched rows, not equal to dense Adam) and the lr schedule.
"""

import math

import torch

from training.config import OptimConfig
from training.data import DataCursor
from training.model import SeqRec
from training.selection import Selection


def build_optimizer(model: SeqRec, cfg: OptimConfig) -> torch.optim.Optimizer:
    table = [model.item_emb.weight]
    dense = [p for n, p in model.named_parameters() if n != "item_emb.weight"]
    beta1, beta2 = cfg.betas
    kind = RowwiseAdamW if cfg.item_optimizer == "rowwise_adam" else torch.optim.AdamW
    return kind(
        [
            {"params": dense, "lr": cfg.lr, "weight_decay": cfg.weight_decay, "name": "dense"},
            {"params": table, "lr": cfg.embedding_lr, "weight_decay": 0.0, "name": "embedding"},
        ],
        betas=(beta1, beta2),
    )


class RowwiseAdamW(torch.optim.AdamW):
    """AdamW whose parameters with a sparse gradient (the item table's touched rows, a
    coalesced COO tensor) get Adam on those rows only; the others get torch's AdamW.

    State keys are AdamW's ("step", "exp_avg", "exp_avg_sq", full-size moments), so
    checkpoints and heals carry it as they carry AdamW's. "step" counts the steps that
    touched the table at all; bias correction uses it (SparseAdam's convention).
    Weight decay is not applied to sparse rows (the table's group has none)."""

    @torch.no_grad()
    def step(self, closure=None):
        sparse = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None and p.grad.is_sparse]
        grads = [p.grad for _, p in sparse]
        for _, p in sparse:
            p.grad = None  # AdamW skips parameters without a gradient
        try:
            loss = super().step(closure)
        finally:
            for (_, p), grad in zip(sparse, grads, strict=True):
                p.grad = grad
        for (group, p), grad in zip(sparse, grads, strict=True):
            self._rows_step(p, grad, group)
        return loss

    def _rows_step(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        grad = grad.coalesce()
        ids, g = grad.indices()[0], grad.values()
        if ids.numel() == 0:
            return
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        state["step"] += 1
        step = float(state["step"])
        m = state["exp_avg"].index_select(0, ids).lerp_(g, 1 - beta1)
        v = state["exp_avg_sq"].index_select(0, ids).mul_(beta2).addcmul_(g, g, value=1 - beta2)
        state["exp_avg"].index_copy_(0, ids, m)
        state["exp_avg_sq"].index_copy_(0, ids, v)
        # the same float operations as torch's AdamW on these rows
        denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(group["eps"])
        p.index_copy_(0, ids, p.index_select(0, ids).addcdiv_(m, denom, value=-lr / (1 - beta1**step)))


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
        selection: Selection | None = None,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.cursor, self.generator = cursor, generator
        self.selection = selection  # eval.best_metric / eval.patience: the verdicts so far
        self.step = 0  # committed steps

    def state_dict(self) -> dict:
        sd = {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "cursor": self.cursor.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "negatives": self.generator.get_state()},
        }
        if self.selection is not None:  # only then: checkpoints without it stay as they were
            sd["selection"] = self.selection.state_dict()
        return sd

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.cursor.load_state_dict(state["cursor"])
        torch.set_rng_state(state["rng"]["torch"])
        self.generator.set_state(state["rng"]["negatives"])
        self.step = int(state["step"])
        if self.selection is not None and "selection" in state:
            self.selection.load_state_dict(state["selection"])
