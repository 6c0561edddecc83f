"""The training loop's components, each acting at its own cadence after a committed step.

Each is built with the objects it uses (the group's comm, the replica, the tracker, the
state, the table) and never reaches back into the `Trainer` that owns it.
"""

import os
import time
from dataclasses import dataclass

import torch

from ftcore import collectives as coll
from training import checkpoint, distributed, metrics
from training.comm.integration import GroupComm
from training.comm.item_table import TrainerTable
from training.config import Config, EvalConfig, TrainConfig
from training.data import DataCursor, ShardSet
from training.distributed import Topology, log
from training.evaluate import EvalData, evaluate
from training.replica import ReplicaSync
from training.selection import Record, Selection
from training.state import TrainState, WarmupDecay
from training.tracking import Tracker


class MetricsLog:
    """The committed steps' records (metrics.Window), logged every train.log_every steps and at
    the last: gathered from the group's ranks (collective), one MLflow call and one line on rank 0."""

    def __init__(
        self,
        every: int,
        topo: Topology,
        gcomm: GroupComm,
        replica: ReplicaSync,
        tracker: Tracker | None,
        cursor: DataCursor,
    ):
        self.every, self.topo, self.gcomm, self.replica = every, topo, gcomm, replica
        self.tracker, self.cursor = tracker, cursor
        self.window, self.history = metrics.Window(), metrics.History()

    def record(self, step: int, loss: torch.Tensor, lr: float, times: metrics.StepTimes, counts: torch.Tensor) -> None:
        self.window.record_step(step, loss.item(), lr, times, counts)

    def maybe_log(self, step: int, steps_total: int) -> None:
        if step % self.every == 0 or step == steps_total:
            self.flush(step, steps_total)

    def flush_rest(self, step: int, steps_total: int) -> None:
        """The run stopped between two log steps: the steps not yet logged."""
        if self.window.steps:
            self.flush(step, steps_total)

    def flush(self, step: int, steps_total: int) -> None:
        per_rank, _, _ = metrics.gather_times(self.window, False)
        comm = self.gcomm.window_metrics()  # collective as well: bubble accounting of training/comm
        cross = self.replica.window_metrics()  # across replica groups (ftcore's pace figures)
        if self.topo.is_main:
            summary = {**metrics.summarize(self.window, per_rank), **comm, **cross}
            if "ft/bubble_fraction" in cross:  # the job's: inside the group, then across groups
                summary["train/bubble_fraction"] = 1.0 - (1.0 - summary["train/bubble_fraction"]) * (
                    1.0 - cross["ft/bubble_fraction"]
                )
            self.history.add(self.window, per_rank)
            if self.tracker:
                self.tracker.log_metrics(summary, step)
            log(
                self.topo,
                f"step {step}/{steps_total} epoch {self.cursor.epoch} loss {summary['train/loss']:.4f} "
                f"lr {summary['train/lr']:.2e} tok/s {summary['train/tokens_per_s']:.0f} "
                f"pad {summary['train/padding_fraction']:.3f} wait {per_rank[:, :, 1].mean():.4f}s",
            )
        self.window = metrics.Window()


class TimeBudget:
    """train.max_minutes, checked at each log step: at a quarter of the budget the lr schedule
    is fitted, once, to the steps the pace allows; past the budget the run stops. The ranks
    agree in one small collective per check (rank 0's proposal; a stop when any rank is over).
    No budget: nothing, no collective."""

    def __init__(self, cfg: TrainConfig, schedule: WarmupDecay, topo: Topology):
        self.minutes, self.seconds, self.every = cfg.max_minutes, 60 * cfg.max_minutes, cfg.log_every
        self.schedule, self.topo, self.fitted = schedule, topo, False

    def maybe_fit(self, step: int, steps_total: int, started: float) -> tuple[int, bool]:
        """Returns (steps_total, stop)."""
        if not self.seconds or not (step % self.every == 0 or step == steps_total):
            return steps_total, False
        elapsed = time.perf_counter() - started
        proposal = step * 0.95 * self.seconds / elapsed if not self.fitted and elapsed > 0.25 * self.seconds else 0.0
        over, proposal = metrics.agree(elapsed > self.seconds, proposal)
        if proposal > 0:
            self.fitted, steps_total = True, max(step + 1, min(steps_total, int(proposal)))
            self.schedule.total = steps_total
            log(self.topo, f"time budget {self.minutes} min: schedule fitted to {steps_total} steps")
        return steps_total, over


class LazyEval:
    """The evaluation users, loaded on first use (rank 0 only evaluates): all of them, and the
    periodic validation's (eval.valid_users: a fixed sample; 0: the same data)."""

    def __init__(self, shards: ShardSet, cfg: Config):
        self.shards, self.cfg = shards, cfg
        self.data: EvalData | None = None
        self.sample: EvalData | None = None

    def get(self) -> EvalData:
        if self.data is None:
            self.data = EvalData(self.shards.eval_path, self.shards.num_items, self.cfg.model.max_len, self.cfg.eval)
        return self.data

    def periodic(self) -> EvalData:
        n = self.cfg.eval.valid_users
        if not n:
            return self.get()
        if self.sample is None:
            path, items, max_len = self.shards.eval_path, self.shards.num_items, self.cfg.model.max_len
            self.sample = EvalData(path, items, max_len, self.cfg.eval, sample=n)
        return self.sample


class Validator:
    """Validation every `every` steps while training goes on (eval.periodic), and the model
    selection's verdict on it (training/selection.py: the best model, early stopping)."""

    def __init__(
        self,
        cfg: EvalConfig,
        every: int,
        model: torch.nn.Module,
        table: TrainerTable,
        topo: Topology,
        eval_data: LazyEval,
        tracker: Tracker | None,
        selection: Selection | None,
    ):
        self.cfg, self.every, self.enabled = cfg, every, cfg.periodic
        self.model, self.table, self.topo, self.eval_data, self.tracker = model, table, topo, eval_data, tracker
        self.selection = selection
        self.seconds = 0.0  # spent validating (rank 0)

    def maybe_validate(self, step: int, more: bool) -> None:
        """`more`: training goes on after this step (the end has its own evaluation)."""
        if not (self.enabled and step % self.every == 0 and more):
            return
        full = self.table.full_model(self.model, self.topo.is_main)  # collective with a sharded table
        scores = {}
        if full is not None and self.topo.is_main:
            t = time.perf_counter()
            scores = evaluate(full, self.eval_data.periodic(), self.cfg, splits=("valid",))
            self.seconds += time.perf_counter() - t
            log(self.topo, f"step {step} valid " + brief(scores, "valid"))
            if self.selection is not None:
                self.selection.offer(scores, full, step)
                scores["valid/best"] = self.selection.value or 0.0
            if self.tracker:
                self.tracker.log_metrics({**scores, "valid/seconds_total": self.seconds}, step)
        if self.selection is not None:
            self.selection.record = share(self.selection.record)  # collective: rank 0's verdict
            if self.selection.stopped_at == step:
                self._stopped(step)
        distributed.barrier()  # the other ranks wait here, not inside the next step's all-reduce

    def _stopped(self, step: int) -> None:
        sel = self.selection
        assert sel is not None
        log(self.topo, f"early stop at step {step}: {sel.reason()}")
        if self.tracker:
            self.tracker.log_metrics({"train/early_stop": 1.0}, step)  # the event, on the curves
            self.tracker.set_tags(
                {
                    "ftrec.early_stop_step": str(step),
                    "ftrec.early_stop_reason": sel.reason(),
                    "ftrec.best_step": str(sel.step),
                    "ftrec.best_metric": sel.metric,
                    "ftrec.best_value": f"{sel.value:.6f}",
                }
            )


def share(record: Record) -> Record:
    """Rank 0's record on every rank of the group (collective; one process: itself)."""
    if not distributed.active():
        return record
    t = record.as_tensor()
    coll.broadcast(t, 0, kind=coll.CONTROL)
    return Record.from_tensor(t)


class Checkpointer:
    """OUT/checkpoints/step-N every train.checkpoint_every steps (0: only at the end) and at the
    end: the TrainState with the full item table, per-rank files beside it, and meta.json."""

    def __init__(
        self,
        cfg: Config,
        state: TrainState,
        table: TrainerTable,
        topo: Topology,
        shards: ShardSet,
        replica: ReplicaSync,
        tracker: Tracker | None,
    ):
        self.cfg, self.state, self.table, self.topo, self.shards = cfg, state, table, topo, shards
        self.replica, self.tracker = replica, tracker
        self.root, self.every = os.path.join(cfg.train.out, "checkpoints"), cfg.train.checkpoint_every
        self.saved, self.last = -1, ""  # the step and folder of the newest save

    def maybe_save(self, step: int) -> None:
        if self.every and step % self.every == 0:
            self.save()

    def save_final(self) -> str:
        """The final step's checkpoint (saved now unless it was already); returns its folder."""
        if self.saved != self.state.step:
            self.save()
        return self.last

    def save(self) -> str:
        """Collective with a sharded table (its rows gathered)."""
        meta, sd = self.meta(), self.state.state_dict()
        self.table.to_checkpoint(sd, meta)
        keep = self.cfg.train.keep_checkpoints
        self.last = checkpoint.save(self.root, sd, meta, rank=self.topo.rank, keep=keep, per_rank=self.table.per_rank)
        self.saved = self.state.step
        return self.last

    def meta(self, with_ft: bool = True) -> dict:
        """A checkpoint's meta.json: for people, `training eval`, warm start and resume;
        `with_ft`: ftcore's make-up work owed (a resumable checkpoint's, not best/'s)."""
        cursor, shards = self.state.cursor, self.shards
        return {
            "mlflow_run_id": self.tracker.run_id if self.tracker else None,
            "step": self.state.step,
            "epoch": cursor.epoch,
            "index": cursor.index,
            "config": self.cfg.to_dict(),
            "num_items": shards.num_items,
            "fingerprint": shards.fingerprint(),
            "shards": os.path.abspath(shards.path),
            "ranks_per_group": self.topo.group_size,
            "replica_groups": self.topo.num_replica_groups,
            **(self.replica.state_for_checkpoint() if with_ft else {}),
        }


@dataclass
class Components:
    """What acts after a committed step, each at its own cadence (the Trainer owns them)."""

    metrics_log: MetricsLog
    budget: TimeBudget
    validator: Validator
    checkpointer: Checkpointer


def brief(scores: dict, split: str) -> str:
    return " ".join(
        f"{p}/{m} {scores[f'{split}/{p}/{m}']:.4f}" for p in ("full", "sampled") for m in ("hr@10", "ndcg@10")
    )
