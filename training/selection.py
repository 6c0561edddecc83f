"""Which model a run ends with: the best validation so far, and early stopping with patience.

`judge` is the rule, a pure function: the record so far and one validation's value in, the
new record out (best value and step, validations since it, the step the run stops at).
`Selection` holds the record in every rank's `TrainState`, so checkpoints and ftcore's heals
carry it: a replica group that heals after a validation holds its peers' verdict and ends
on the same step. Rank 0 also keeps the best model's weights (they travel with it too).
"""

import os
from dataclasses import dataclass

import numpy as np
import torch

from training import checkpoint
from training.config import ConfigError, EvalConfig


@dataclass(frozen=True)
class Record:
    """The validations so far. value None: none yet."""

    value: float | None = None  # the best value of the metric
    step: int = -1  # the step it was measured at
    stale: int = 0  # validations since, none better
    stopped_at: int = 0  # the step early stopping ends the run at; 0: it goes on

    def as_tensor(self) -> torch.Tensor:
        v = float("nan") if self.value is None else self.value
        return torch.tensor([v, self.step, self.stale, self.stopped_at], dtype=torch.float64)

    @staticmethod
    def from_tensor(t: torch.Tensor) -> "Record":
        v, step, stale, stopped = t.tolist()
        return Record(None if v != v else v, int(step), int(stale), int(stopped))


def judge(rec: Record, value: float, step: int, patience: int) -> Record:
    """One validation: strictly better than the best is the new best; otherwise one more stale
    validation, and with `patience` > 0 the run stops at this step once `patience` are stale."""
    if rec.value is None or value > rec.value:
        return Record(value, step, 0, 0)
    stale = rec.stale + 1
    return Record(rec.value, rec.step, stale, step if 0 < patience <= stale else 0)


class Selection:
    """eval.best_metric / eval.patience for one rank: the record (every rank, via rank 0) and,
    on rank 0, the best model's tensors on the CPU."""

    def __init__(self, metric: str, patience: int):
        self.metric, self.patience = metric, patience
        self.record = Record()
        self.weights: dict[str, torch.Tensor] | None = None

    @property
    def value(self) -> float | None:
        return self.record.value

    @property
    def step(self) -> int:
        return self.record.step

    @property
    def stopped_at(self) -> int:
        return self.record.stopped_at

    def last_step(self, steps_total: int) -> int:
        """The run's step budget: steps_total, or the step early stopping ended it at."""
        return min(steps_total, self.record.stopped_at) if self.record.stopped_at else steps_total

    def metric_value(self, scores: dict) -> float:
        if self.metric not in scores:
            raise ConfigError(
                f"eval.best_metric={self.metric!r} is not a validation metric; choose one of "
                f"{', '.join(sorted(k for k in scores if k.startswith('valid/')))}"
            )
        return scores[self.metric]

    def offer(self, scores: dict, model: torch.nn.Module, step: int) -> Record:
        """Rank 0: one validation's scores of `model` at `step`; keeps its weights when best."""
        self.record = judge(self.record, self.metric_value(scores), step, self.patience)
        if self.record.step == step:
            self.weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        return self.record

    def beats(self, final_scores: dict) -> bool:
        """The best validated model is strictly better than the final one: a tie keeps the last."""
        value = self.record.value
        return self.weights is not None and value is not None and value > self.metric_value(final_scores)

    def reason(self) -> str:
        """Why the run stopped early, in one line ("" when it did not)."""
        if not self.record.stopped_at:
            return ""
        return (
            f"{self.metric} did not improve on {self.record.value:.4f} (step {self.record.step}) in "
            f"{self.record.stale} validations (eval.patience={self.patience})"
        )

    def save(self, out: str, meta: dict) -> str:
        """OUT/best/step-N: a weights-only checkpoint (`training eval` and warm start read it);
        `meta` is the run's, minus the data position of a state it does not hold."""
        meta = {**{k: v for k, v in meta.items() if k not in ("epoch", "index")}, "step": self.record.step}
        return checkpoint.save(os.path.join(out, "best"), {"model": self.weights}, meta, keep=1, distributed=False)

    def state_dict(self) -> dict:
        r = self.record
        return {
            "metric": self.metric,
            "value": r.value,
            "step": r.step,
            "stale": r.stale,
            "stopped_at": r.stopped_at,
            "weights": self.weights,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.record = Record(sd["value"], int(sd["step"]), int(sd["stale"]), int(sd["stopped_at"]))
        self.weights = sd.get("weights")


def selection_metric(cfg: EvalConfig) -> str:
    """The validation metric that picks the run's model: eval.best_metric, or with early stopping
    on and none named, the full-ranking NDCG@10 the retrain gate judges (not a sampled one)."""
    return cfg.best_metric or (DEFAULT_METRIC if cfg.patience > 0 else "")


DEFAULT_METRIC = "valid/full/ndcg@10"


def make_selection(cfg: EvalConfig) -> Selection | None:
    """The run's Selection, None when it keeps the last model. ConfigError before training when
    the metric is not one validation reports (every rank builds it, so every rank stops alike)."""
    from training.evaluate import ranking_metrics

    metric = selection_metric(cfg)
    if not metric:
        return None
    names = [f"valid/{p}/{m}" for p in ("full", "sampled") for m in ranking_metrics(np.zeros(1), tuple(cfg.ks))]
    if metric not in names:
        default = "" if cfg.best_metric else " (eval.patience's default)"
        raise ConfigError(
            f"eval.best_metric={metric!r}{default} is not a validation metric; choose one of {', '.join(sorted(names))}"
        )
    return Selection(metric, cfg.patience)
