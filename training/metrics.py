"""Per-step measurements, aggregated over a window of steps for logging, and the plots.

Each rank records, per step: compute time (data wait excluded: forward, loss, backward,
optimizer) and collective wait (time blocked in the group's all-reduces and in the
cross-group ft.allreduce: transfer plus waiting for the slowest rank, the bubble).
Every `log_every` steps the ranks all-gather their window (one small collective) and
rank 0 turns it into one MLflow log call: means and rates over the window, per-rank
compute and wait, and the bubble fraction 1 - mean/max of per-step compute.
"""

import os
from dataclasses import dataclass, field

import torch

from ftcore import collectives as coll
from training import distributed

# columns of a rank's per-step record; LOSS is the rank's share of the group's mean loss
COMPUTE, WAIT, STEP_TIME, DATA_WAIT, LOSS = range(5)
COLUMNS = 5


@dataclass
class Window:
    steps: list[int] = field(default_factory=list)
    times: list[list[float]] = field(default_factory=list)   # per step: the COLUMNS above
    lr: list[float] = field(default_factory=list)
    samples: float = 0.0      # global (whole replica group)
    tokens: float = 0.0       # global non-padding tokens
    padded: float = 0.0       # global tokens after padding each rank's batch

    def record(self, step: int, loss_share: float, lr: float, compute: float, wait: float, step_time: float,
               data_wait: float, samples: float, tokens: float, padded: float) -> None:
        """One committed step; samples/tokens/padded are the group's totals."""
        self.steps.append(step)
        self.times.append([compute, wait, step_time, data_wait, loss_share])
        self.lr.append(lr)
        self.samples += samples
        self.tokens += tokens
        self.padded += padded


def gather_times(window: Window, stop: bool, proposal: float = 0.0, group=None) -> tuple[torch.Tensor, bool, float]:
    """All ranks' [steps, COLUMNS] records -> [K, steps, COLUMNS], whether any rank asked to
    stop, and rank 0's `proposal` (a number every rank then agrees on).

    Collective: every rank of the group calls it at the same step.
    """
    mine = torch.tensor(window.times, dtype=torch.float64).reshape(-1, COLUMNS)
    flag = torch.zeros((1, COLUMNS), dtype=torch.float64)
    flag[0, 0], flag[0, 1] = (1.0 if stop else 0.0), proposal
    mine = torch.cat([mine, flag])
    if distributed.active():   # timings and flags: control values (ftcore/collectives.py)
        allt = torch.stack(coll.all_gather(mine, kind=coll.CONTROL, group=group))
    else:
        allt = mine[None]
    return allt[:, :-1], bool(allt[:, -1, 0].max() > 0), float(allt[0, -1, 1])


def summarize(window: Window, per_rank: torch.Tensor) -> dict[str, float]:
    """One window -> the metrics logged for its last step."""
    wall = float(per_rank[:, :, STEP_TIME].max(0).values.sum())   # a step lasts as long as its slowest rank
    compute = per_rank[:, :, COMPUTE]
    out = {
        "train/loss": float(per_rank[:, :, LOSS].sum(0).mean()),
        "train/lr": window.lr[-1],
        "train/samples_per_s": window.samples / wall if wall else 0.0,
        "train/tokens_per_s": window.tokens / wall if wall else 0.0,
        "train/step_time_s": wall / per_rank.shape[1],
        "train/padding_fraction": 1.0 - window.tokens / window.padded if window.padded else 0.0,
        "train/bubble_fraction": float(1.0 - (compute.mean(0) / compute.max(0).values.clamp_min(1e-12)).mean()),
    }
    for k in range(per_rank.shape[0]):
        out[f"rank{k}/compute_s"] = float(per_rank[k, :, COMPUTE].mean())
        out[f"rank{k}/wait_s"] = float(per_rank[k, :, WAIT].mean())
        out[f"rank{k}/data_wait_s"] = float(per_rank[k, :, DATA_WAIT].mean())
    return out


@dataclass
class History:
    """What rank 0 keeps for the end-of-run plots: loss per step, per-rank step times."""
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    rank_times: list[torch.Tensor] = field(default_factory=list)   # [K, steps, COLUMNS] per window
    samples: float = 0.0
    tokens: float = 0.0
    padded: float = 0.0

    def add(self, window: Window, per_rank: torch.Tensor) -> None:
        self.samples += window.samples
        self.tokens += window.tokens
        self.padded += window.padded
        self.steps += window.steps
        self.loss += per_rank[:, :, LOSS].sum(0).tolist()
        self.rank_times.append(per_rank)


def run_summary(history: History) -> dict[str, float]:
    """Whole-run throughput: non-padding tokens/s over the slowest rank's step times, and more."""
    if not history.rank_times:
        return {}
    t = torch.cat(history.rank_times, dim=1)
    wall = float(t[:, :, STEP_TIME].max(0).values.sum())
    compute = t[:, :, COMPUTE]
    return {"steps": int(t.shape[1]), "step_seconds": wall, "tokens": history.tokens,
            "tokens_per_s": history.tokens / wall if wall else 0.0,
            "samples_per_s": history.samples / wall if wall else 0.0,
            "padding_fraction": 1.0 - history.tokens / history.padded if history.padded else 0.0,
            "compute_s_per_step": float(compute.mean()),
            "wait_s_per_step": float(t[:, :, WAIT].mean()),
            "bubble_fraction": float(1.0 - (compute.mean(0) / compute.max(0).values.clamp_min(1e-12)).mean())}


def plot(history: History, path: str) -> str | None:
    """PNG: training loss per step, and compute / step time per rank per step."""
    if not history.steps:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    times = torch.cat(history.rank_times, dim=1)
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    a.plot(history.steps, history.loss, lw=0.8)
    a.set_ylabel("train loss")
    a.set_title("loss and per-rank step times")
    for k in range(times.shape[0]):
        b.plot(history.steps, times[k, :, STEP_TIME].numpy() * 1e3, lw=0.6, label=f"rank {k} step")
        b.plot(history.steps, times[k, :, COMPUTE].numpy() * 1e3, lw=0.6, ls="--", label=f"rank {k} compute")
    b.set_xlabel("step")
    b.set_ylabel("ms")
    b.legend(fontsize=7)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return path
