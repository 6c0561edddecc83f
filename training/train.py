"""The training loop: `Trainer` sets up, then runs one step transaction per batch.

Every step is a transaction (../shared/DESIGN.md, ftcore), `Trainer.train_step`:

    ft.start_quorum()
    batch = ft.next_batch(loader)          # the cursor does NOT move yet; None: no batch for
                                           # this group this step (ftcore make-up), zero gradients
    forward, loss / global target count, backward
    all-reduce gradients in the replica group (SUM)
    ft.allreduce(gradients)                # average across replica groups
    if ft.should_commit(): clip, optimizer.step, scheduler.step, ft.advance(loader)
    else:                   drop the gradients; the same batch is retried

The loop (`Trainer.train`) ends when `ft.data_done(...)`: after steps_total steps for one
group; with ftcore, when every epoch and every make-up step of a group that was down is done
(ftcore/schedule.py); or when a component stops it (train.max_minutes, train.stop_at_step).
After each committed step the components act at their own cadence: `MetricsLog.maybe_log`
(train.log_every), `TimeBudget.maybe_fit` (train.max_minutes), `Validator.maybe_validate`
(train.eval_every) and `Checkpointer.maybe_save` (train.checkpoint_every).

`ft` is `training.ft.make_replica(...)`: the one-group `LocalReplica`, or ftcore's `FTReplica`
when FTCORE_LIGHTHOUSE names a lighthouse (the launcher, or torchrun on a cluster). The item
table is a `TrainerTable` (training/comm/item_table.py): sharded over the group's ranks
(comm.embedding = "sharded"), or the model's own nn.Embedding. One `metrics.StepTimer`
times the step's phases for both the MLflow window and the bubble accounting (GroupComm).
"""

import copy
import os
import time
from typing import Any, Protocol, cast

import torch

from dataprep.fsutil import atomic_write_json
from training import checkpoint, distributed, memory, metrics, rows, serving
from training import ft as ft_mod
from training.comm.integration import GroupComm
from training.comm.item_table import ReplicatedItemTable, RowwiseItemTable, ShardedItemTable, TrainerTable
from training.config import Config, ConfigError, TrainConfig, to_toml
from training.data import Batch, BatchLoader, DataCursor, ShardSet, shard_ranks_for
from training.distributed import Topology
from training.evaluate import EvalData, evaluate
from training.loss import draw_negatives, loss_sum, start_global_counts
from training.model import SeqRec
from training.state import TrainState, WarmupDecay, build_optimizer
from training.tracking import Tracker, code_tags


def log(topo: Topology, msg: str) -> None:
    if topo.is_main:
        print(f"[train g{topo.replica_group}] {msg}", flush=True)


def write_json(path: str, obj: dict) -> None:
    atomic_write_json(path, obj, indent=1, sort_keys=True)


def train(cfg: Config) -> dict:
    """Train on cfg.data.shards into cfg.train.out; returns the result.json dict (rank 0)."""
    return Trainer(cfg).train()


class _Work(Protocol):  # an async collective's handle (loss.start_global_counts)
    def wait(self) -> Any: ...


class Trainer:
    """One rank of one replica group: the set-up, the step transaction, the loop, the end."""

    def __init__(self, cfg: Config):
        self.cfg, self.topo = cfg, distributed.init()
        self.shards, self.shard_ranks = _open_shards(cfg, self.topo)
        self.out, self.ckpt_root = cfg.train.out, os.path.join(cfg.train.out, "checkpoints")
        os.makedirs(self.out, exist_ok=True)
        torch.use_deterministic_algorithms(cfg.train.deterministic, warn_only=True)
        resumed_from = self._build_model()
        self.gcomm = GroupComm(cfg.comm, rank=self.topo.rank, device=self.topo.device)  # group all-reduce, bubbles
        self.table = self._item_table()
        distributed.broadcast_params(self.model, exclude=self.table.rank_params)
        self._build_state()
        if resumed_from:
            self._resume(resumed_from)
        self.ft = ft_mod.make_replica(self.state, self.topo, self.steps_total, self.out)
        if resumed_from:  # ftcore: the make-up work still owed at the checkpoint
            self.ft.load_from_checkpoint(checkpoint.read_meta(resumed_from))
        self.loader = BatchLoader(self.shards, self.shard_ranks, self.cursor, cfg.data.prefetch)
        self.pad_to = cfg.model.max_len if cfg.data.pad_to_max_len else 0
        # loss.normalize = "epoch": the group's mean target count per step (a constant of the shard set)
        self.tokens_per_step = (
            self.shards.tokens_per_step / self.topo.num_replica_groups if cfg.loss.normalize == "epoch" else 0.0
        )
        self.tracker = self._open_tracker(resumed_from)
        self.eval_data = _LazyEval(self.shards, cfg)
        self.timer = metrics.StepTimer(self.gcomm)  # one clock for the window and the bubble accounting
        self.metrics_log, self.budget = MetricsLog(self), TimeBudget(cfg.train, self.schedule, self.topo)
        self.validator, self.checkpointer = Validator(self), Checkpointer(self)
        self.stop, self.started = False, 0.0
        log(
            self.topo,
            f"{self.shards.num_items} items, {self.shards.steps} steps/epoch, {self.steps_total} steps, "
            f"shards {self.shard_ranks}, {self.topo.group_size} rank(s) x "
            f"{self.topo.num_replica_groups} group(s)",
        )

    # ---- set-up ---------------------------------------------------------------------------
    def _build_model(self) -> str | None:
        """The seeded model (the same on every rank), warm-started from train.init_checkpoint
        unless a checkpoint to resume from is found; returns that checkpoint."""
        cfg, topo, shards = self.cfg, self.topo, self.shards
        budget = memory.rank_budget(cfg.train.memory_budget_gb, torch.device(topo.device))  # collective
        cfg.comm.embedding, line = memory.choose_embedding(
            cfg.comm.embedding, shards.num_items, cfg.model.dim, cfg.optim.item_optimizer, topo.group_size, budget
        )  # before the table exists: a table that cannot fit is refused, not allocated
        log(topo, line)
        torch.manual_seed(cfg.train.seed)  # the same initial model on every rank
        self.model = SeqRec(shards.num_items, cfg.model).to(topo.device)
        resumed_from = checkpoint.latest_verified(self.ckpt_root, lambda m: log(topo, m)) if cfg.train.resume else None
        if cfg.train.init_checkpoint and not resumed_from:
            # into the full table, before any sharding: every rank then keeps its rows of it
            carried = checkpoint.warm_start(self.model, cfg.train.init_checkpoint, shards.path)
            log(
                topo,
                f"warm start from {cfg.train.init_checkpoint}: {carried}/{shards.num_items} item embeddings "
                "carried over",
            )
        return resumed_from

    def _item_table(self) -> TrainerTable:
        """comm.embedding = "sharded" with K > 1 ranks: this rank's rows replace the model's table."""
        topo, transport = self.topo, self.gcomm.transport
        if self.cfg.comm.embedding == "sharded" and transport is not None:
            # every rank keeps its rows of the seeded replicated init: the full table is unchanged
            table = ShardedItemTable(self.model.item_emb.weight, transport, self.gcomm.sched)
            self.model.add_module("item_emb", table)
            log(topo, f"item table sharded row-wise over {topo.group_size} ranks: rank 0 holds rows {table.row_range}")
            if self.cfg.optim.item_optimizer == "rowwise_adam":
                table.use_rows(self._cross_group_rows())  # Adam on each shard's touched rows
            return table
        if self.cfg.comm.embedding == "sharded":
            log(topo, "comm.embedding=sharded with 1 rank per replica group: the item table stays replicated")
        if self.cfg.optim.item_optimizer == "rowwise_adam":
            return RowwiseItemTable(self.model.item_emb, self._cross_group_rows())
        return ReplicatedItemTable()

    def _cross_group_rows(self) -> tuple[int, int, int] | None:
        """rowwise_adam across replica groups: (this group's slot, groups, the rows bound)."""
        shards, groups, k = self.shards, self.topo.num_replica_groups, self.topo.group_size
        if groups == 1:
            return None
        w = shards.world_size
        reads = [[r for i in range(k) for r in shard_ranks_for(w, groups, g, k, i)] for g in range(groups)]
        loss = self.cfg.loss
        cap = rows.rows_bound(rows.shard_step_counts(shards), reads, loss.kind, loss.num_negatives, shards.num_items)
        return self.topo.replica_group, groups, cap

    def _build_state(self) -> None:
        """Optimizer, lr schedule, data cursor and RNG: the TrainState checkpoints and heals carry."""
        cfg, topo, model = self.cfg, self.topo, self.model
        torch.manual_seed(cfg.train.seed + 7919 * (1 + topo.rank))  # dropout differs per rank, like DDP
        # Negatives: the same stream on every rank of the group, so the group's step shares one
        # negative set exactly as one big batch in one process would.
        self.generator = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + 17)
        self.params = list(model.parameters())
        # a shard's grad is summed by the table itself, and so are touched rows (rowwise_adam)
        own = {id(p) for p in (*self.table.rank_params, *self.table.row_params)}
        self.group_params = [p for p in self.params if id(p) not in own]
        self.optimizer = build_optimizer(model, cfg.optim)
        self.steps_total = cfg.train.max_steps or cfg.train.epochs * self.shards.steps
        self.schedule = WarmupDecay(cfg.optim, self.steps_total)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        self.cursor = DataCursor(self.shards.steps, cfg.train.seed)
        self.state = TrainState(model, self.optimizer, self.scheduler, self.cursor, self.generator)

    def _resume(self, path: str) -> None:
        state = checkpoint.load(path, self.topo.rank, per_rank=self.table.per_rank)
        self.state.load_state_dict(self.table.from_checkpoint(state))
        # the resumed run logs into the MLflow run it started, unless one is given
        self.cfg.mlflow.run_id = self.cfg.mlflow.run_id or checkpoint.read_meta(path).get("mlflow_run_id") or ""
        c = self.cursor
        log(self.topo, f"resumed from {path} (step {self.state.step}, epoch {c.epoch}, index {c.index})")

    def _open_tracker(self, resumed_from: str | None) -> Tracker | None:
        """One MLflow run per job, one value per (metric, step): replica group 0's rank 0 tracks.
        The other groups train the same model; their own facts (commits, restarts, heals) reach
        the run as group<g>/... metrics from the launcher's timeline."""
        cfg, topo, shards = self.cfg, self.topo, self.shards
        if not (cfg.mlflow.enabled and topo.is_main and topo.replica_group == 0):
            return None
        restarted = any(
            int(os.environ.get(k, "0") or 0) > 0 for k in ("FTCORE_INCARNATION", "TORCHELASTIC_RESTART_COUNT")
        )
        tracker = Tracker(cfg.mlflow, self.out, continue_recorded=restarted)
        # keys that differ between the attempts of one run would be refused by MLflow
        volatile = {"train.resume", "train.stop_at_step", "mlflow.run_id"}
        run_params = {k: v for k, v in cfg.flat().items() if k not in volatile}
        tracker.log_params(
            {
                **run_params,
                **topo.as_params(),
                "data.fingerprint": shards.fingerprint(),
                "data.num_items": shards.num_items,
                "data.steps_per_epoch": shards.steps,
                "data.world_size": shards.world_size,
                "data.bubble_fraction": shards.manifest.get("bubble_fraction", ""),
            }
        )
        path = os.path.abspath(shards.path)
        tracker.set_tags({"ftrec.resumed_from": resumed_from or "", "ftrec.shards": path, **code_tags()})
        # MLflow's dataset digest holds 36 characters: a prefix of the input fingerprint (full one in params)
        tracker.log_input(
            os.path.basename(path),
            shards.fingerprint()[:36],
            path,
            {
                "samples": shards.manifest.get("num_samples"),
                "users": shards.manifest.get("num_users"),
                "items": shards.num_items,
                "steps": shards.steps,
            },
        )
        return tracker

    # ---- the loop -------------------------------------------------------------------------
    def train(self) -> dict:
        """Step transactions until the data is done or a component stops the run, then the end.
        Returns the result.json dict on rank 0, {} on the other ranks."""
        self.started = time.perf_counter()
        self.model.train()
        while not self.stop and not self.ft.data_done(self.state.step, self.steps_total):
            if not self.train_step():
                continue  # another replica group failed: the same batch again
            step = self.state.step
            self.metrics_log.maybe_log(step, self.steps_total)  # collective
            self.steps_total, over = self.budget.maybe_fit(step, self.steps_total, self.started)
            self.stop = over or step == self.cfg.train.stop_at_step
            self.validator.maybe_validate(step, more=not self.stop and step < self.steps_total)
            self.checkpointer.maybe_save(step)
        return self.finish()

    def train_step(self) -> bool:
        """One step transaction (the module docstring); False: not committed, to be retried."""
        timer, ft = self.timer, self.ft
        timer.step_begin(self.state.step)
        ft.start_quorum()
        batch = ft.next_batch(self.loader)  # None: no batch for this group this step
        timer.compute_begin("forward_backward")
        loss, counts = self.forward_backward(batch)
        timer.compute_end()
        timer.add_wait(self.table.take_lookup_wait(), in_compute=True)  # rows the forward pass waited for
        # the replica group's all-reduce (SUM); a sharded table's grads arrive meanwhile
        timer.add_wait(self.gcomm.allreduce_grads(self.group_params, default=distributed.allreduce_grads))
        timer.add_wait(self.table.finish_grads())
        timer.wait(ft.allreduce, self.table.cross_group_grads(self.params))  # the average across replica groups
        self.table.after_cross_group()
        if not ft.should_commit():  # the vote: another replica group failed
            timer.abort()
            self.optimizer.zero_grad(set_to_none=True)
            return False
        timer.compute_begin("optimizer")
        lr = self.optimizer_step()
        ft.advance(self.loader)  # the data moves on commit only
        self.state.step += 1
        timer.compute_end()
        times = timer.step_end()
        self.metrics_log.record(self.state.step, loss, lr, times, counts)  # loss.item(): after the step's timing
        return True

    def forward_backward(self, batch: Batch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, loss / the group's target count, backward; returns (loss, the group's
        [targets, samples, padded tokens]). No batch (ftcore): zero gradients."""
        if batch is None:
            rows_only = {id(p) for p in self.table.row_params}  # no rows touched: no gradient
            for p in self.params:
                p.grad = None if id(p) in rows_only else torch.zeros_like(p)
            return torch.zeros(()), torch.zeros(3, dtype=torch.float64)
        cfg, dev = self.cfg, self.topo.device
        values, offsets, labels = (t.to(dev) for t in (batch.values, batch.offsets, batch.labels))
        padded = max(int(batch.lengths.max()), self.pad_to) * batch.num_samples
        counts, pending = start_global_counts([batch.num_targets, batch.num_samples, padded])  # overlaps fwd
        negatives = draw_negatives(self.shards.num_items, cfg.loss, labels, self.generator)
        # a sharded table: this step's lookups and the next batch's id exchange, issued by comm.policy
        self.table.start_lookups(batch.step, [values, labels, negatives], self._ahead)
        ts = batch.timestamps.to(dev) if batch.timestamps is not None else None
        h = self.model(values, offsets, self.pad_to, timestamps=ts)
        total = loss_sum(self.model, h, labels, cfg.loss, negatives=negatives)
        if pending is not None:
            self.timer.wait(cast(_Work, pending).wait)
        loss = total / (counts[0].item() if cfg.loss.normalize == "step" else self.tokens_per_step)
        loss.backward()
        self.table.start_grads()  # a sharded table's grads to their owners (a SUM over the group)
        return loss, counts

    def _ahead(self) -> tuple[int, list[torch.Tensor]]:
        """The batch expected next, for a table that prefetches its id exchange."""
        ahead = self.loader.peek_ahead(1)
        return ahead.step, [ahead.values, ahead.labels]

    def optimizer_step(self) -> float:
        """Clip to the global norm, step at ftcore's lr scale; returns the lr the step used."""
        if self.cfg.optim.grad_clip > 0:
            self.table.clip_grads_(self.params, self.cfg.optim.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        lr_scale = self.ft.lr_scale()
        if lr_scale != 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] *= lr_scale  # scheduler.step() below recomputes from the schedule
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr * lr_scale

    # ---- the end: final checkpoint, test, result.json --------------------------------------
    def finish(self) -> dict:
        """The last window, ftcore's final state, the final checkpoint; rank 0 tests and reports."""
        self.metrics_log.flush_rest(self.state.step, self.steps_total)
        self.loader.close()
        comm = self.table.summary()
        if comm is not None:
            log(
                self.topo,
                f"comm.policy={comm['policy']}: the next batch's id exchange was prefetched and used in "
                f"{comm['prefetch_hits']} of {comm['prefetch_hits'] + comm['prefetch_misses']} steps",
            )
        # ftcore: the group's final tensor-only state for the launcher, then leave the quorum
        self.ft.finish(per_rank=self.table.sharded)
        final = self.checkpointer.save_final()
        model = self.table.full_model(self.model, self.topo.is_main)  # collective: rank 0 sees the full table
        timeline_png = self.gcomm.finish(os.path.join(self.out, "artifacts"))  # collective
        result = self._report(model, final, timeline_png) if model is not None and self.topo.is_main else {}
        distributed.barrier()
        return result

    def _report(self, model: torch.nn.Module, final: str, timeline_png: str | None) -> dict:
        """Rank 0: the final evaluation, result.json, and the MLflow run's last metrics and artifacts."""
        wall = time.perf_counter() - self.started
        t_eval = time.perf_counter()
        scores, final, last = self._final_eval(model, final)
        c, best = self.cursor, self.validator.best
        result: dict[str, Any] = {
            "mlflow_run_id": None,
            "tracking_uri": self.tracker.uri if self.tracker else None,
            "checkpoint": os.path.abspath(final),
            "steps": self.state.step,
            "metrics": scores,
            "train_seconds": wall,
            "epochs_completed": c.epoch + c.index / self.shards.steps,
            "throughput": metrics.run_summary(self.metrics_log.history),
            "eval_seconds": time.perf_counter() - t_eval,
        }
        if best is not None:
            result["best"] = {
                "metric": best.metric,
                "step": best.step if last else self.state.step,
                "value": scores.get(best.metric),
                "last_checkpoint": os.path.abspath(last or final),
            }
        comm = self.table.summary()
        if comm is not None:
            result["comm"] = comm
        if self.tracker:
            self.tracker.log_metrics(scores, self.state.step)
            if timeline_png:
                self.tracker.log_artifact(timeline_png)
            self._log_artifacts(self.tracker, model)
            result["mlflow_unsent"] = self.tracker.close()
            result["mlflow_run_id"] = self.tracker.run_id
        write_json(os.path.join(self.out, "result.json"), result)
        return result

    def _final_eval(self, model: torch.nn.Module, final: str) -> tuple[dict, str, str | None]:
        """valid + test of the final model, or of the best validated one when it peaked higher
        (eval.best_metric); returns (scores, the run's checkpoint, the last one if not that)."""
        scores: dict = {}
        if not self.cfg.eval.final:
            return scores, final, None
        scores = evaluate(model, self.eval_data.get(), self.cfg.eval, splits=("valid", "test"))
        log(self.topo, "valid " + _brief(scores, "valid") + " | test " + _brief(scores, "test"))
        best = self.validator.best
        if best is None or best.state is None or not best.beats(scores):
            return scores, final, None
        # an earlier validation peaked higher: that model is the run's (training is over)
        model.load_state_dict(best.state)
        scores = evaluate(model, self.eval_data.get(), self.cfg.eval, splits=("valid", "test"))
        chosen = best.save(self.out, self.checkpointer.meta(with_ft=False))
        log(
            self.topo,
            f"{best.metric} peaked at step {best.step} ({best.value:.4f}): that model is the "
            f"run's, in {chosen} | test " + _brief(scores, "test"),
        )
        return scores, chosen, final

    def _log_artifacts(self, tracker: Tracker, model: torch.nn.Module) -> None:
        cfg, art = self.cfg, os.path.join(self.out, "artifacts")
        os.makedirs(art, exist_ok=True)
        with open(os.path.join(art, "config.toml"), "w") as f:
            f.write(to_toml(cfg))
        tracker.log_artifact(os.path.join(art, "config.toml"))
        tracker.log_artifact(os.path.join(self.shards.path, "manifest.json"))
        if cfg.mlflow.plots and metrics.plot(self.metrics_log.history, os.path.join(art, "training.png")):
            tracker.log_artifact(os.path.join(art, "training.png"))
        if cfg.mlflow.log_model:
            try:
                exported = serving.export(
                    copy.deepcopy(model).cpu().eval(), self.shards.path, os.path.join(art, "serving")
                )
            except Exception as e:  # a model torch.export cannot take must not cost the run its results
                print(f"[train] model not logged: export failed ({type(e).__name__}: {e})", flush=True)
                tracker.errors.append(f"model: export failed: {type(e).__name__}: {e}")
            else:
                tracker.log_model(exported, cfg.mlflow.register, cfg.mlflow.model_name)


def _open_shards(cfg: Config, topo: Topology) -> tuple[ShardSet, list[int]]:
    """The shard set and the shards this rank reads; model.max_len 0 takes the manifest's."""
    shards = ShardSet(cfg.data.shards)
    shard_ranks = shard_ranks_for(
        shards.world_size, topo.num_replica_groups, topo.replica_group, topo.group_size, topo.rank
    )
    cfg.model.max_len = cfg.model.max_len or shards.max_len
    if cfg.model.max_len < shards.max_len:
        raise ConfigError(
            f"model.max_len={cfg.model.max_len} is shorter than the shard set's max_len="
            f"{shards.max_len}; leave it 0 to take the manifest's"
        )
    return shards, shard_ranks


# ---- the components: each decides its own cadence -------------------------------------------
class MetricsLog:
    """The committed steps' records (metrics.Window), logged every train.log_every steps and at
    the last: gathered from the group's ranks (collective), one MLflow call and one line on rank 0."""

    def __init__(self, trainer: Trainer):
        self.t, self.every = trainer, trainer.cfg.train.log_every
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
        t = self.t
        per_rank, _, _ = metrics.gather_times(self.window, False)
        comm = t.gcomm.window_metrics()  # collective as well: bubble accounting of training/comm
        cross = t.ft.window_metrics()  # across replica groups (ftcore's pace figures)
        if t.topo.is_main:
            summary = {**metrics.summarize(self.window, per_rank), **comm, **cross}
            if "ft/bubble_fraction" in cross:  # the job's: inside the group, then across groups
                summary["train/bubble_fraction"] = 1.0 - (1.0 - summary["train/bubble_fraction"]) * (
                    1.0 - cross["ft/bubble_fraction"]
                )
            self.history.add(self.window, per_rank)
            if t.tracker:
                t.tracker.log_metrics(summary, step)
            log(
                t.topo,
                f"step {step}/{steps_total} epoch {t.cursor.epoch} loss {summary['train/loss']:.4f} "
                f"lr {summary['train/lr']:.2e} tok/s {summary['train/tokens_per_s']:.0f} "
                f"pad {summary['train/padding_fraction']:.3f} wait {per_rank[:, :, 1].mean():.4f}s",
            )
        self.window = metrics.Window()


class TimeBudget:
    """train.max_minutes. Checked as often as the window is logged (train.log_every, and the
    last step): once a quarter of the budget is spent, the lr schedule is fitted, once, to the
    steps the pace so far allows (validations included), so the lr decays by the deadline;
    past the budget the run stops. The group's ranks agree (one small collective per check):
    rank 0's proposal, and a stop when any rank is over. No budget: nothing, no collective."""

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


class Validator:
    """Validation every train.eval_every steps (0: once per epoch) while training goes on
    (eval.periodic), and rank 0's copy of the best model so far (eval.best_metric)."""

    def __init__(self, trainer: Trainer):
        cfg = trainer.cfg
        self.t, self.every, self.enabled = trainer, cfg.train.eval_every or trainer.shards.steps, cfg.eval.periodic
        self.best = _Best(cfg.eval.best_metric) if cfg.eval.best_metric and trainer.topo.is_main else None

    def maybe_validate(self, step: int, more: bool) -> None:
        """`more`: training goes on after this step (the end has its own evaluation)."""
        if not (self.enabled and step % self.every == 0 and more):
            return
        t = self.t
        full = t.table.full_model(t.model, t.topo.is_main)  # collective with a sharded table
        scores = {}
        if full is not None and t.topo.is_main:
            scores = evaluate(full, t.eval_data.get(), t.cfg.eval, splits=("valid",))
            log(t.topo, f"step {step} valid " + _brief(scores, "valid"))
            if t.tracker:
                t.tracker.log_metrics(scores, step)
        distributed.barrier()  # the other ranks wait here, not inside the next step's all-reduce
        if self.best is not None and full is not None:
            self.best.offer(scores, full, step)


class Checkpointer:
    """OUT/checkpoints/step-N every train.checkpoint_every steps (0: only at the end) and at the
    end: the TrainState with the full item table, per-rank files beside it, and meta.json."""

    def __init__(self, trainer: Trainer):
        self.t, self.every = trainer, trainer.cfg.train.checkpoint_every
        self.saved, self.last = -1, ""  # the step and folder of the newest save

    def maybe_save(self, step: int) -> None:
        if self.every and step % self.every == 0:
            self.save()

    def save_final(self) -> str:
        """The final step's checkpoint (saved now unless it was already); returns its folder."""
        if self.saved != self.t.state.step:
            self.save()
        return self.last

    def save(self) -> str:
        """Collective with a sharded table (its rows gathered)."""
        t = self.t
        meta, sd = self.meta(), t.state.state_dict()
        t.table.to_checkpoint(sd, meta)
        self.last = checkpoint.save(
            t.ckpt_root, sd, meta, rank=t.topo.rank, keep=t.cfg.train.keep_checkpoints, per_rank=t.table.per_rank
        )
        self.saved = t.state.step
        return self.last

    def meta(self, with_ft: bool = True) -> dict:
        """A checkpoint's meta.json: for people, `training eval`, warm start and resume;
        `with_ft`: ftcore's make-up work owed (a resumable checkpoint's, not best/'s)."""
        t = self.t
        return {
            "mlflow_run_id": t.tracker.run_id if t.tracker else None,
            "step": t.state.step,
            "epoch": t.cursor.epoch,
            "index": t.cursor.index,
            "config": t.cfg.to_dict(),
            "num_items": t.shards.num_items,
            "fingerprint": t.shards.fingerprint(),
            "shards": os.path.abspath(t.shards.path),
            "ranks_per_group": t.topo.group_size,
            "replica_groups": t.topo.num_replica_groups,
            **(t.ft.state_for_checkpoint() if with_ft else {}),
        }


class _LazyEval:
    """The evaluation users, loaded on first use (rank 0 only evaluates)."""

    def __init__(self, shards: ShardSet, cfg: Config):
        self.shards, self.cfg = shards, cfg
        self.data: EvalData | None = None

    def get(self) -> EvalData:
        if self.data is None:
            self.data = EvalData(self.shards.eval_path, self.shards.num_items, self.cfg.model.max_len, self.cfg.eval)
        return self.data


def _brief(scores: dict, split: str) -> str:
    return " ".join(
        f"{p}/{m} {scores[f'{split}/{p}/{m}']:.4f}" for p in ("full", "sampled") for m in ("hr@10", "ndcg@10")
    )


class _Best:
    """Rank 0's copy of the model where validation metric `metric` peaked (eval.best_metric)."""

    def __init__(self, metric: str):
        self.metric, self.value, self.step = metric, float("-inf"), -1
        self.state: dict | None = None

    def _value(self, scores: dict) -> float:
        if self.metric not in scores:
            raise ConfigError(
                f"eval.best_metric={self.metric!r} is not a validation metric; choose one of "
                f"{', '.join(sorted(k for k in scores if k.startswith('valid/')))}"
            )
        return scores[self.metric]

    def offer(self, scores: dict, model: torch.nn.Module, step: int) -> None:
        if self._value(scores) > self.value:
            self.value, self.step = self._value(scores), step
            self.state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def beats(self, final_scores: dict) -> bool:
        """Strictly better than the final model: a tie keeps the last."""
        return self.state is not None and self.value > self._value(final_scores)

    def save(self, out: str, meta: dict) -> str:
        """OUT/best/step-N: a weights-only checkpoint (`training eval` and warm start read it);
        `meta` is the run's, minus the data position of a state it does not hold."""
        meta = {**{k: v for k, v in meta.items() if k not in ("epoch", "index")}, "step": self.step}
        return checkpoint.save(os.path.join(out, "best"), {"model": self.state}, meta, keep=1, distributed=False)
