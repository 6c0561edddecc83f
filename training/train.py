"""The training loop: `Trainer` sets up, then runs one step transaction per batch.

A step commits on every replica group or on none (`Trainer.train_step`); after a committed
step the components (training/components.py) act at their own cadence. The loop ends when
the replica says the data is done or a component stops it. docs/training.md has the walk-through.
"""

import copy
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from ftcore.util.files import atomic_write_json
from training import checkpoint, distributed, memory, metrics, rows, serving
from training.comm.integration import GroupComm
from training.comm.item_table import ReplicatedItemTable, RowwiseItemTable, ShardedItemTable, TrainerTable
from training.components import (
    Checkpointer,
    Components,
    LazyEval,
    MetricsLog,
    TimeBudget,
    Validator,
    brief,
)
from training.config import Config, ConfigError, to_toml
from training.data import Batch, BatchLoader, DataCursor, ShardSet, shard_ranks_for
from training.distributed import Topology, log
from training.evaluate import beside, evaluate
from training.loss import draw_negatives, loss_sum, negatives_per, resolve_kind, start_global_counts
from training.model import SeqRec
from training.replica import LocalReplica, make_replica
from training.selection import Selection, make_selection
from training.state import TrainState, WarmupDecay, build_optimizer
from training.tracking import Tracker, code_tags


def write_json(path: str, obj: dict) -> None:
    atomic_write_json(path, obj, indent=1, sort_keys=True)


def train(cfg: Config) -> dict:
    """Train on cfg.data.shards into cfg.train.out; returns the result.json dict (rank 0)."""
    return Trainer(cfg).train()


class _Work(Protocol):  # an async collective's handle (loss.start_global_counts)
    def wait(self) -> Any: ...


@dataclass(frozen=True)
class _BatchShape:
    """pad_to: tokens a batch is padded to (data.pad_to_max_len), 0: its longest sequence;
    tokens_per_step: loss.normalize = "epoch"'s divisor (the group's mean targets per step), else 0."""

    pad_to: int
    tokens_per_step: float


class Trainer:
    """One rank of one replica group: the set-up, the step transaction, the loop, the end."""

    def __init__(self, cfg: Config):
        self.topo = distributed.init()
        self.cfg, self.shards, shard_ranks = _open_shards(cfg, self.topo)  # resolved: the caller's cfg as given
        cfg = self.cfg
        os.makedirs(cfg.train.out, exist_ok=True)
        torch.use_deterministic_algorithms(cfg.train.deterministic, warn_only=True)
        resumed_from = self._build_model()
        self.gcomm = GroupComm(cfg.comm, rank=self.topo.rank, device=self.topo.device)  # group all-reduce, bubbles
        self.table = self._item_table()
        distributed.broadcast_params(self.model, exclude=self.table.rank_params)
        schedule = self._build_state()
        if resumed_from:
            self._resume(resumed_from)
            cfg = self.cfg  # with the resumed run's MLflow run
        self.ft = make_replica(self.state, self.topo, self.steps_total, cfg.train.out)
        if resumed_from:  # ftcore: the make-up work still owed at the checkpoint
            self.ft.load_from_checkpoint(checkpoint.read_meta(resumed_from))
        self.loader = BatchLoader(self.shards, shard_ranks, self.state.cursor, cfg.data.prefetch)
        self.shape = _BatchShape(
            pad_to=cfg.model.max_len if cfg.data.pad_to_max_len else 0,
            tokens_per_step=(
                self.shards.tokens_per_step / self.topo.num_replica_groups if cfg.loss.normalize == "epoch" else 0.0
            ),
        )
        self.tracker = self._open_tracker(resumed_from)
        self.eval_data = LazyEval(self.shards, cfg)
        self.timer = metrics.StepTimer(self.gcomm)  # one clock for the window and the bubble accounting
        self.parts = self._components(schedule)
        self.started = 0.0
        log(
            self.topo,
            f"{self.shards.num_items} items, {self.shards.steps} steps/epoch, {self.steps_total} steps, "
            f"shards {shard_ranks}, {self.topo.group_size} rank(s) x "
            f"{self.topo.num_replica_groups} group(s)",
        )

    def _components(self, schedule: WarmupDecay) -> Components:
        """Each component gets the objects it uses, not the Trainer."""
        cfg, topo, state, tracker = self.cfg, self.topo, self.state, self.tracker
        return Components(
            metrics_log=MetricsLog(cfg.train.log_every, topo, self.gcomm, self.ft, tracker, state.cursor),
            budget=TimeBudget(cfg.train, schedule, topo),
            validator=Validator(
                cfg.eval,
                cfg.train.eval_every or self.shards.steps,
                self.model,
                self.table,
                topo,
                self.eval_data,
                tracker,
                state.selection,
            ),
            checkpointer=Checkpointer(cfg, state, self.table, topo, self.shards, self.ft, tracker),
        )

    # ---- set-up ---------------------------------------------------------------------------
    def _build_model(self) -> str | None:
        """The seeded model (the same on every rank), warm-started from train.init_checkpoint
        unless a checkpoint to resume from is found; returns that checkpoint."""
        cfg, topo, shards = self.cfg, self.topo, self.shards
        checkpoint.key()  # every rank, before any collective: no key, no run (nothing could be sealed)
        self._choose_table_and_loss()
        torch.manual_seed(cfg.train.seed)  # the same initial model on every rank
        self.model = SeqRec(shards.num_items, cfg.model).to(topo.device)
        resumed_from = (
            checkpoint.latest_verified(os.path.join(cfg.train.out, "checkpoints"), lambda m: log(topo, m))
            if cfg.train.resume
            else None
        )
        if cfg.train.init_checkpoint and not resumed_from:
            # into the full table, before any sharding: every rank then keeps its rows of it
            carried = checkpoint.warm_start(self.model, cfg.train.init_checkpoint, shards.path)
            log(
                topo,
                f"warm start from {cfg.train.init_checkpoint}: {carried}/{shards.num_items} item embeddings "
                "carried over",
            )
        return resumed_from

    def _choose_table_and_loss(self) -> None:
        """comm.embedding and loss.kind as this run resolves them ("auto"), before the table
        exists: a table that cannot fit is refused, not allocated."""
        cfg, topo, shards = self.cfg, self.topo, self.shards
        budget = memory.rank_budget(cfg.train.memory_budget_gb, torch.device(topo.device))  # collective
        rows = memory.lookup_rows(
            shards, negatives_per(cfg.loss, shards.num_items), topo.num_replica_groups, topo.group_size
        )
        cfg.comm.embedding, line = memory.choose_embedding(
            cfg.comm.embedding, shards.num_items, cfg.model.dim, cfg.optim.item_optimizer, topo.group_size, budget, rows
        )
        sharded = cfg.comm.embedding == "sharded" and topo.group_size > 1
        if sharded and cfg.loss.kind == "softmax":
            raise ConfigError(
                "loss.kind='softmax' scores every item on every rank: it needs the replicated item table "
                f"(comm.embedding=replicated), which does not fit here ({line}); use loss.kind='sampled_softmax'"
            )
        cfg.loss.kind, why = resolve_kind(cfg.loss, shards.num_items, sharded)
        log(topo, f"{line}; {why}")

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
        cap = rows.rows_bound(
            rows.shard_step_counts(shards), reads, negatives_per(self.cfg.loss, shards.num_items), shards.num_items
        )
        return self.topo.replica_group, groups, cap

    def _build_state(self) -> WarmupDecay:
        """Optimizer, lr schedule, data cursor and RNG: the TrainState checkpoints and heals carry;
        returns the lr schedule (the time budget refits it)."""
        cfg, topo, model = self.cfg, self.topo, self.model
        torch.manual_seed(cfg.train.seed + 7919 * (1 + topo.rank))  # dropout differs per rank, like DDP
        # Negatives: the same stream on every rank of the group, so the group's step shares one
        # negative set exactly as one big batch in one process would.
        generator = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + 17)
        self.params = list(model.parameters())
        # a shard's grad is summed by the table itself, and so are touched rows (rowwise_adam)
        own = {id(p) for p in (*self.table.rank_params, *self.table.row_params)}
        self.group_params = [p for p in self.params if id(p) not in own]
        optimizer = build_optimizer(model, cfg.optim)
        self.steps_total = cfg.train.max_steps or cfg.train.epochs * self.shards.steps
        schedule = WarmupDecay(cfg.optim, self.steps_total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        cursor = DataCursor(self.shards.steps, cfg.train.seed)
        self.state = TrainState(model, optimizer, scheduler, cursor, generator, make_selection(cfg.eval))
        return schedule

    def _resume(self, path: str) -> None:
        state = checkpoint.load(path, self.topo.rank, per_rank=self.table.per_rank)
        self.state.load_state_dict(self.table.from_checkpoint(state))
        # the resumed run logs into the MLflow run it started, unless one is given
        run_id = self.cfg.mlflow.run_id or checkpoint.read_meta(path).get("mlflow_run_id") or ""
        self.cfg = dataclasses.replace(self.cfg, mlflow=dataclasses.replace(self.cfg.mlflow, run_id=run_id))
        c = self.state.cursor
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
        tracker = Tracker(cfg.mlflow, cfg.train.out, continue_recorded=restarted)
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
                **{f"data.split.{k}": v for k, v in (shards.manifest.get("split") or {}).items()},
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
        self.started, stop, parts = time.perf_counter(), False, self.parts
        self.model.train()
        if not isinstance(self.ft, LocalReplica) and not self.table.sharded:
            self.warm_up()
        while not stop and not self.ft.data_done(self.state.step, self._last_step()):
            if not self.train_step():
                continue  # another replica group failed: the same batch again
            step = self.state.step
            parts.metrics_log.maybe_log(step, self.steps_total)  # collective
            self.steps_total, over = parts.budget.maybe_fit(step, self.steps_total, self.started)
            stop = over or step == self.cfg.train.stop_at_step
            parts.validator.maybe_validate(step, more=not stop and step < self.steps_total)
            parts.checkpointer.maybe_save(step)
        return self.finish()

    def _last_step(self) -> int:
        """steps_total, or the step early stopping ended the run at (eval.patience). The verdict
        is in the TrainState, so a replica group that healed since has it too: every group ends
        at the same step, through ftcore's end of a step budget (every group live, then done)."""
        sel = self.state.selection
        return sel.last_step(self.steps_total) if sel is not None else self.steps_total

    def warm_up(self) -> None:
        """One forward and backward on the cursor's batch, thrown away, before this group first
        asks for a quorum: a new process's first step (lazy set-up and first allocations, 0.4-1.6 s
        here against 30 ms later) is paid before its peers wait for it in an FTAR, not by them.
        Nothing of it stays: gradients dropped, both random generators restored."""
        cuda = torch.device(self.topo.device).type == "cuda"
        rng, gen = torch.get_rng_state(), self.state.generator.get_state()
        dev_rng = torch.cuda.get_rng_state(self.topo.device) if cuda else None
        self.forward_backward(self.loader.peek())
        for p in self.params:
            p.grad = None
        torch.set_rng_state(rng)
        self.state.generator.set_state(gen)
        if dev_rng is not None:
            torch.cuda.set_rng_state(dev_rng, self.topo.device)

    def train_step(self) -> bool:
        """One step transaction (the module docstring); False: not committed, to be retried."""
        timer, ft, optimizer = self.timer, self.ft, self.state.optimizer
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
            optimizer.zero_grad(set_to_none=True)
            return False
        timer.compute_begin("optimizer")
        lr = self.optimizer_step()
        ft.advance(self.loader)  # the data moves on commit only
        self.state.step += 1
        timer.compute_end()
        times = timer.step_end()
        self.parts.metrics_log.record(self.state.step, loss, lr, times, counts)  # loss.item(): after the step's timing
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
        padded = max(int(batch.lengths.max()), self.shape.pad_to) * batch.num_samples
        counts, pending = start_global_counts([batch.num_targets, batch.num_samples, padded])  # overlaps fwd
        negatives = draw_negatives(self.shards.num_items, cfg.loss, labels, self.state.generator)
        # a sharded table: this step's lookups and the next batch's id exchange, issued by comm.policy
        self.table.start_lookups(batch.key, [values, labels, negatives], self._ahead)
        ts = batch.timestamps.to(dev) if batch.timestamps is not None else None
        h = self.model(values, offsets, self.shape.pad_to, timestamps=ts)
        total = loss_sum(self.model, h, labels, cfg.loss, negatives=negatives)
        if pending is not None:
            self.timer.wait(cast(_Work, pending).wait)
        loss = total / (counts[0].item() if cfg.loss.normalize == "step" else self.shape.tokens_per_step)
        loss.backward()
        self.table.start_grads()  # a sharded table's grads to their owners (a SUM over the group)
        return loss, counts

    def _ahead(self) -> tuple[tuple[int, int], list[torch.Tensor]]:
        """The batch expected next, for a table that prefetches its id exchange."""
        ahead = self.loader.peek_ahead(1)
        return ahead.key, [ahead.values, ahead.labels]

    def optimizer_step(self) -> float:
        """Clip to the global norm, step at ftcore's lr scale; returns the lr the step used."""
        optimizer = self.state.optimizer
        if self.cfg.optim.grad_clip > 0:
            self.table.clip_grads_(self.params, self.cfg.optim.grad_clip)
        lr = optimizer.param_groups[0]["lr"]
        lr_scale = self.ft.lr_scale()
        if lr_scale != 1.0:
            for group in optimizer.param_groups:
                group["lr"] *= lr_scale  # scheduler.step() below recomputes from the schedule
        optimizer.step()
        self.state.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return lr * lr_scale

    # ---- the end: final checkpoint, test, result.json --------------------------------------
    def finish(self) -> dict:
        """The last window, ftcore's final state, the final checkpoint; rank 0 tests and reports."""
        self.parts.metrics_log.flush_rest(self.state.step, self.steps_total)
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
        final = self.parts.checkpointer.save_final()
        model = self.table.full_model(self.model, self.topo.is_main)  # collective: rank 0 sees the full table
        timeline_png = self.gcomm.finish(os.path.join(self.cfg.train.out, "artifacts"))  # collective
        result = self._report(model, final, timeline_png) if model is not None and self.topo.is_main else {}
        distributed.barrier()
        return result

    def _report(self, model: torch.nn.Module, final: str, timeline_png: str | None) -> dict:
        """Rank 0: the final evaluation, result.json, and the MLflow run's last metrics and artifacts."""
        wall = time.perf_counter() - self.started
        t_eval = time.perf_counter()
        scores, final, last = self._final_eval(model, final)
        if scores and self.cfg.eval.baseline:  # beside the run's model's: coverage, most popular
            scores.update(beside(model, self.eval_data.get(), self.cfg.eval))
        c, best = self.state.cursor, self.state.selection
        result: dict[str, Any] = {
            "mlflow_run_id": None,
            "tracking_uri": self.tracker.uri if self.tracker else None,
            "checkpoint": os.path.abspath(final),
            "steps": self.state.step,
            "metrics": scores,
            "train_seconds": wall,
            "epochs_completed": c.epoch + c.index / self.shards.steps,
            "throughput": metrics.run_summary(self.parts.metrics_log.history),
            "eval_seconds": time.perf_counter() - t_eval,
        }
        if best is not None:
            result.update(self._selection_result(best, scores, last or final, chosen=last is not None))
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
        write_json(os.path.join(self.cfg.train.out, "result.json"), result)
        return result

    def _selection_result(self, sel: Selection, scores: dict, last: str, chosen: bool) -> dict:
        """result.json's "best" (and "early_stop" when the run stopped early); the chosen step is
        also the MLflow run's tag ftrec.best_step."""
        step = sel.step if chosen else self.state.step
        out: dict[str, Any] = {
            "best": {
                "metric": sel.metric,
                "step": step,
                "value": scores.get(sel.metric),
                "last_checkpoint": os.path.abspath(last),
                "validation_seconds": self.parts.validator.seconds,
            }
        }
        if sel.stopped_at:
            out["early_stop"] = {"step": sel.stopped_at, "reason": sel.reason(), "patience": sel.patience}
        if self.tracker:
            self.tracker.set_tags({"ftrec.best_step": str(step), "ftrec.best_metric": sel.metric})
        return out

    def _final_eval(self, model: torch.nn.Module, final: str) -> tuple[dict, str, str | None]:
        """valid + test of the final model, or of the best validated one when it peaked higher
        (eval.best_metric); returns (scores, the run's checkpoint, the last one if not that)."""
        scores: dict = {}
        if not self.cfg.eval.final:
            return scores, final, None
        scores = evaluate(model, self.eval_data.get(), self.cfg.eval, splits=("valid", "test"))
        log(self.topo, "valid " + brief(scores, "valid") + " | test " + brief(scores, "test"))
        best = self.state.selection
        if best is None or best.weights is None:
            return scores, final, None
        cfg = self.cfg.eval  # the last model is judged on the users the best was (eval.valid_users)
        last = evaluate(model, self.eval_data.periodic(), cfg, splits=("valid",)) if cfg.valid_users else scores
        if not best.beats(last):
            return scores, final, None
        # an earlier validation peaked higher: that model is the run's (training is over)
        model.load_state_dict(best.weights)
        scores = evaluate(model, self.eval_data.get(), self.cfg.eval, splits=("valid", "test"))
        chosen = best.save(self.cfg.train.out, self.parts.checkpointer.meta(with_ft=False))
        log(
            self.topo,
            f"{best.metric} peaked at step {best.step} ({best.value:.4f}): that model is the "
            f"run's, in {chosen} | test " + brief(scores, "test"),
        )
        return scores, chosen, final

    def _log_artifacts(self, tracker: Tracker, model: torch.nn.Module) -> None:
        cfg, art = self.cfg, os.path.join(self.cfg.train.out, "artifacts")
        os.makedirs(art, exist_ok=True)
        with open(os.path.join(art, "config.toml"), "w") as f:
            f.write(to_toml(cfg))
        tracker.log_artifact(os.path.join(art, "config.toml"))
        tracker.log_artifact(os.path.join(self.shards.path, "manifest.json"))
        if cfg.mlflow.plots and metrics.plot(self.parts.metrics_log.history, os.path.join(art, "training.png")):
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


def _open_shards(cfg: Config, topo: Topology) -> tuple[Config, ShardSet, list[int]]:
    """The run's configuration, the shard set and the shards this rank reads. The configuration
    is `cfg` resolved against the set (model.max_len 0 takes the manifest's): a copy, the
    caller's `cfg` is never written."""
    shards = ShardSet(cfg.data.shards)
    shard_ranks = shard_ranks_for(
        shards.world_size, topo.num_replica_groups, topo.replica_group, topo.group_size, topo.rank
    )
    built = (shards.manifest.get("split") or {}).get("kind", "leave_one_out")
    if cfg.eval.split and cfg.eval.split != built:
        raise ConfigError(
            f"eval.split={cfg.eval.split!r}, but shard set {cfg.data.shards} was built with {built!r}: rebuild "
            f"it with `python -m dataprep shards ... --split {cfg.eval.split}`, or leave eval.split empty"
        )
    max_len = cfg.model.max_len or shards.max_len
    if max_len < shards.max_len:
        raise ConfigError(
            f"model.max_len={max_len} is shorter than the shard set's max_len={shards.max_len}; "
            "leave it 0 to take the manifest's"
        )
    resolved = dataclasses.replace(copy.deepcopy(cfg), model=dataclasses.replace(cfg.model, max_len=max_len))
    return resolved, shards, shard_ranks
