"""The training loop. Reads top to bottom: set up, then one step transaction per batch.

Every step is a transaction (../shared/DESIGN.md, ftcore):

    ft.start_quorum()
    batch = ft.next_batch(loader)          # the cursor does NOT move yet; None: no batch for
                                           # this group this step (ftcore make-up), zero gradients
    forward, loss / global target count, backward
    all-reduce gradients in the replica group (SUM)
    ft.allreduce(gradients)                # average across replica groups
    if ft.should_commit(): clip, optimizer.step, scheduler.step, ft.advance(loader)
    else:                   drop the gradients; the same batch is retried

The loop ends when `ft.data_done(...)`: after steps_total steps for one group; with ftcore,
when every epoch and every make-up step of a group that was down is done (ftcore/schedule.py).

`ft` is `training.ft.make_replica(...)`: the one-group `LocalReplica`, or ftcore's `FTReplica`
when FTCORE_LIGHTHOUSE names a lighthouse (the launcher, or torchrun on a cluster).
"""

import copy
import json
import os
import time

import torch

from training import checkpoint, distributed, metrics, serving
from training import ft as ft_mod
from training.comm.integration import GroupComm
from training.comm.item_table import ShardedItemTable, grad_norm_sq
from training.config import Config, ConfigError, to_toml
from training.data import BatchLoader, DataCursor, ShardSet, shard_ranks_for
from training.evaluate import EvalData, evaluate
from training.loss import draw_negatives, loss_sum, start_global_counts
from training.model import SeqRec
from training.state import TrainState, WarmupDecay, build_optimizer
from training.tracking import Tracker, code_tags


def log(topo, msg: str) -> None:
    if topo.is_main:
        print(f"[train g{topo.replica_group}] {msg}", flush=True)




def write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def train(cfg: Config) -> dict:
    """Train on cfg.data.shards into cfg.train.out; returns the result.json dict (rank 0)."""
    # ---- set-up -----------------------------------------------------------------------
    topo = distributed.init()
    shards = ShardSet(cfg.data.shards)
    shard_ranks = shard_ranks_for(shards.world_size, topo.num_replica_groups, topo.replica_group,
                                  topo.group_size, topo.rank)
    cfg.model.max_len = cfg.model.max_len or shards.max_len
    if cfg.model.max_len < shards.max_len:
        raise ConfigError(f"model.max_len={cfg.model.max_len} is shorter than the shard set's max_len="
                          f"{shards.max_len}; leave it 0 to take the manifest's")
    out, ckpt_root = cfg.train.out, os.path.join(cfg.train.out, "checkpoints")
    os.makedirs(out, exist_ok=True)
    torch.use_deterministic_algorithms(cfg.train.deterministic, warn_only=True)

    torch.manual_seed(cfg.train.seed)                      # the same initial model on every rank
    model = SeqRec(shards.num_items, cfg.model).to(topo.device)
    resumed_from = checkpoint.latest_verified(ckpt_root, lambda m: log(topo, m)) if cfg.train.resume else None
    if cfg.train.init_checkpoint and not resumed_from:
        # into the full table, before any sharding: every rank then keeps its rows of it
        carried = checkpoint.warm_start(model, cfg.train.init_checkpoint, shards.path)
        log(topo, f"warm start from {cfg.train.init_checkpoint}: {carried}/{shards.num_items} item embeddings carried over")
    gcomm = GroupComm(cfg.comm, rank=topo.rank, device=topo.device)  # group all-reduce + bubble accounting
    table = None   # comm.embedding = "sharded" with K > 1: this rank's rows of the item table
    if cfg.comm.embedding == "sharded" and gcomm.transport is not None:
        # every rank keeps its rows of the seeded replicated init: the full table is unchanged
        table = ShardedItemTable(model.item_emb.weight, gcomm.transport, gcomm.sched)
        model.item_emb = table
        log(topo, f"item table sharded row-wise over {topo.group_size} ranks: rank 0 holds rows {table.row_range}")
    elif cfg.comm.embedding == "sharded":
        log(topo, "comm.embedding=sharded with 1 rank per replica group: the item table stays replicated")
    distributed.broadcast_params(model, exclude=(table.weight,) if table else ())
    torch.manual_seed(cfg.train.seed + 7919 * (1 + topo.rank))  # dropout differs per rank, like DDP
    # Negatives: the same stream on every rank of the group, so the group's step shares one
    # negative set exactly as one big batch in one process would.
    generator = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + 17)
    params = list(model.parameters())
    group_params = [p for p in params if table is None or p is not table.weight]  # the shard's grad is summed by start/finish_grads
    optimizer = build_optimizer(model, cfg.optim)
    steps_total = cfg.train.max_steps or cfg.train.epochs * shards.steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupDecay(cfg.optim, steps_total))
    cursor = DataCursor(shards.steps, cfg.train.seed)
    state = TrainState(model, optimizer, scheduler, cursor, generator)

    if resumed_from:
        state.load_state_dict(_local_rows(checkpoint.load(resumed_from, topo.rank, per_rank=_per_rank(table)), table))
        # the resumed run logs into the MLflow run it started, unless one is given
        cfg.mlflow.run_id = cfg.mlflow.run_id or checkpoint.read_meta(resumed_from).get("mlflow_run_id") or ""
        log(topo, f"resumed from {resumed_from} (step {state.step}, epoch {cursor.epoch}, index {cursor.index})")
    ft = ft_mod.make_replica(state, topo, steps_total, out)
    if resumed_from:    # ftcore: the make-up work still owed at the checkpoint
        ft.load_from_checkpoint(checkpoint.read_meta(resumed_from))
    loader = BatchLoader(shards, shard_ranks, cursor, cfg.data.prefetch)
    pad_to = cfg.model.max_len if cfg.data.pad_to_max_len else 0
    # loss.normalize = "epoch": the group's mean target count per step (a constant of the shard set)
    tokens_per_step = shards.tokens_per_step / topo.num_replica_groups if cfg.loss.normalize == "epoch" else 0.0

    # One MLflow run per job, one value per (metric, step): replica group 0's rank 0 tracks.
    # The other groups train the same model; their own facts (commits, restarts, heals) reach
    # the run as group<g>/... metrics from the launcher's timeline.
    restarted = any(int(os.environ.get(k, "0") or 0) > 0 for k in ("FTCORE_INCARNATION", "TORCHELASTIC_RESTART_COUNT"))
    tracker = (Tracker(cfg.mlflow, out, continue_recorded=restarted)
               if (cfg.mlflow.enabled and topo.is_main and topo.replica_group == 0) else None)
    if tracker:
        # keys that differ between the attempts of one run would be refused by MLflow
        volatile = {"train.resume", "train.stop_at_step", "mlflow.run_id"}
        run_params = {k: v for k, v in cfg.flat().items() if k not in volatile}
        tracker.log_params({**run_params, **topo.as_params(), "data.fingerprint": shards.fingerprint(),
                            "data.num_items": shards.num_items, "data.steps_per_epoch": shards.steps,
                            "data.world_size": shards.world_size, "data.bubble_fraction":
                            shards.manifest.get("bubble_fraction", "")})
        tracker.set_tags({"ftrec.resumed_from": resumed_from or "", "ftrec.shards": os.path.abspath(shards.path),
                          **code_tags()})
        # MLflow's dataset digest holds 36 characters: a prefix of the input fingerprint (full one in params)
        tracker.log_input(os.path.basename(os.path.abspath(shards.path)), shards.fingerprint()[:36],
                          os.path.abspath(shards.path), {"samples": shards.manifest.get("num_samples"),
                                                         "users": shards.manifest.get("num_users"),
                                                         "items": shards.num_items, "steps": shards.steps})
    eval_data = _LazyEval(shards, cfg)
    eval_every = cfg.train.eval_every or shards.steps
    log(topo, f"{shards.num_items} items, {shards.steps} steps/epoch, {steps_total} steps, "
              f"shards {shard_ranks}, {topo.group_size} rank(s) x {topo.num_replica_groups} group(s)")

    # ---- the loop ---------------------------------------------------------------------
    window, history = metrics.Window(), metrics.History()
    started = time.perf_counter()
    stop, saved, fitted = False, -1, False
    comm_totals = {"lookup_wait_s": 0.0, "emb_grad_wait_s": 0.0}   # a sharded table's exposed comm, rank 0
    best = _Best(cfg.eval.best_metric) if cfg.eval.best_metric and topo.is_main else None
    model.train()
    while not stop and not ft.data_done(state.step, steps_total):
        t_step = time.perf_counter()
        gcomm.step_begin(state.step)
        ft.start_quorum()
        batch = ft.next_batch(loader)
        t_data = time.perf_counter()
        gcomm.compute_begin("forward_backward")
        wait = 0.0
        if batch is None:                   # ftcore: no batch for this group: zero gradients
            loss, counts = torch.zeros(()), torch.zeros(3, dtype=torch.float64)
            for p in params:
                p.grad = torch.zeros_like(p)
        else:
            values, offsets, labels = (t.to(topo.device) for t in (batch.values, batch.offsets, batch.labels))
            padded = max(int(batch.lengths.max()), pad_to) * batch.num_samples
            counts, pending = start_global_counts([batch.num_targets, batch.num_samples, padded])  # overlaps fwd
            negatives = draw_negatives(shards.num_items, cfg.loss, labels, generator)
            if table is not None:
                # this step's lookups and the next batch's id exchange, issued by comm.policy
                ahead = loader.peek_ahead(1)
                table.start_step(batch.step, [values, labels, negatives],
                                 ahead.step, [ahead.values, ahead.labels])
            ts = batch.timestamps.to(topo.device) if batch.timestamps is not None else None
            h = model(values, offsets, pad_to, timestamps=ts)
            total = loss_sum(model, h, labels, cfg.loss, negatives=negatives)
            if pending is not None:
                t = time.perf_counter()
                pending.wait()
                wait = time.perf_counter() - t
            loss = total / (counts[0].item() if cfg.loss.normalize == "step" else tokens_per_step)
            loss.backward()
            if table is not None:
                table.start_grads()       # embedding grads to their owners (a SUM over the group) ...
        t_bwd = time.perf_counter()
        gcomm.compute_end()
        if table is not None:
            lookup_wait = table.take_exposed()  # rows the forward pass waited for
            comm_totals["lookup_wait_s"] += lookup_wait
            wait += lookup_wait
        compute = t_bwd - t_data - wait
        wait += gcomm.allreduce_grads(group_params, default=distributed.allreduce_grads)
        if table is not None and batch is not None:
            t = time.perf_counter()
            table.finish_grads()          # ... while the dense gradients were all-reduced
            grad_wait = time.perf_counter() - t
            comm_totals["emb_grad_wait_s"] += grad_wait
            wait += grad_wait
        t = time.perf_counter()
        ft.allreduce([p.grad for p in params])
        wait += time.perf_counter() - t

        if not ft.should_commit():          # another replica group failed: retry this batch
            gcomm.abort_step()
            optimizer.zero_grad(set_to_none=True)
            continue
        t_opt = time.perf_counter()
        gcomm.compute_begin("optimizer")
        if cfg.optim.grad_clip > 0 and table is not None:   # the global norm: shard norms all-reduced
            dense = [p.grad for p in group_params if p.grad is not None]
            sq = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in dense])).double() ** 2
            norm = (sq + grad_norm_sq(table.weight)).sqrt().float()
            torch.nn.utils.clip_grads_with_norm_(params, cfg.optim.grad_clip, norm)
        elif cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        lr = optimizer.param_groups[0]["lr"]
        lr_scale = ft.lr_scale()
        if lr_scale != 1.0:
            for group in optimizer.param_groups:
                group["lr"] *= lr_scale        # scheduler.step() below recomputes from the schedule
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        ft.advance(loader)                  # the data moves on commit only
        state.step += 1
        gcomm.compute_end()
        gcomm.step_end()
        t_end = time.perf_counter()

        # ---- bookkeeping: metrics, validation, checkpoints (outside step timing) ---------
        window.record(state.step, loss.item(), lr * lr_scale,
                      compute=compute + (t_end - t_opt), wait=wait, step_time=t_end - t_step,
                      data_wait=t_data - t_step, tokens=float(counts[0]), samples=float(counts[1]),
                      padded=float(counts[2]))
        if state.step % cfg.train.log_every == 0 or state.step == steps_total:
            elapsed, budget = time.perf_counter() - started, 60 * cfg.train.max_minutes
            proposal = 0.0
            if budget and not fitted and elapsed > 0.25 * budget:
                # Fit the schedule to the time budget once, at the pace seen so far (validations
                # included), so the lr decays by the deadline. Rank 0 proposes, all ranks agree.
                proposal = state.step * 0.95 * budget / elapsed
            stop, proposal = _flush_window(window, history, tracker, gcomm, state.step, steps_total, cursor.epoch,
                                           topo, bool(budget) and elapsed > budget, proposal, ft)
            if proposal > 0:
                fitted, steps_total = True, max(state.step + 1, min(steps_total, int(proposal)))
                scheduler.lr_lambdas[0].total = steps_total
                log(topo, f"time budget {cfg.train.max_minutes} min: schedule fitted to {steps_total} steps")
            window = metrics.Window()
        if state.step == cfg.train.stop_at_step:
            stop = True
        if cfg.eval.periodic and state.step % eval_every == 0 and state.step < steps_total and not stop:
            full = _full_model(model, table, topo)
            scores = _validate(full, eval_data, cfg, tracker, state.step, topo)
            if best is not None:
                best.offer(scores, full, state.step)
        if cfg.train.checkpoint_every and state.step % cfg.train.checkpoint_every == 0:
            final, saved = _save(state, cfg, shards, topo, ckpt_root, tracker, table, ft), state.step

    # ---- the end: final checkpoint, test, result.json ----------------------------------
    if window.steps:  # stopped between two log steps
        _flush_window(window, history, tracker, gcomm, state.step, steps_total, cursor.epoch, topo, False, 0.0, ft)
    loader.close()
    if table is not None:
        log(topo, f"comm.policy={cfg.comm.policy}: the next batch's id exchange was prefetched and used in "
                  f"{table.prefetch_hits} of {table.prefetch_hits + table.prefetch_misses} steps")
    if hasattr(ft, "finish"):
        ft.finish(per_rank=table is not None)   # ftcore: the group's final tensor-only state for the launcher, then leave the quorum
    if saved != state.step:
        final = _save(state, cfg, shards, topo, ckpt_root, tracker, table, ft)
    model = _full_model(model, table, topo)     # collective: evaluation and model logging see the full table
    timeline_png = gcomm.finish(os.path.join(out, "artifacts"))   # collective
    result, last = {}, None   # last: the final checkpoint when an earlier model is the run's
    if topo.is_main:
        wall = time.perf_counter() - started
        scores = {}
        t_eval = time.perf_counter()
        if cfg.eval.final:
            scores = evaluate(model, eval_data.get(), cfg.eval, splits=("valid", "test"))
            log(topo, "valid " + _brief(scores, "valid") + " | test " + _brief(scores, "test"))
            if best is not None and best.beats(scores):
                # an earlier validation peaked higher: that model is the run's (training is over)
                model.load_state_dict(best.state)
                scores = evaluate(model, eval_data.get(), cfg.eval, splits=("valid", "test"))
                last, final = final, best.save(out, _meta(state, cfg, shards, topo, tracker))
                log(topo, f"{best.metric} peaked at step {best.step} ({best.value:.4f}): that model is the "
                          f"run's, in {final} | test " + _brief(scores, "test"))
        result = {"mlflow_run_id": None, "tracking_uri": tracker.uri if tracker else None,
                  "checkpoint": os.path.abspath(final), "steps": state.step, "metrics": scores,
                  "train_seconds": wall, "epochs_completed": cursor.epoch + cursor.index / shards.steps,
                  "throughput": metrics.run_summary(history), "eval_seconds": time.perf_counter() - t_eval}
        if best is not None:
            result["best"] = {"metric": best.metric, "step": best.step if last else state.step,
                              "value": scores.get(best.metric), "last_checkpoint": os.path.abspath(last or final)}
        if table is not None:
            result["comm"] = {"policy": cfg.comm.policy, "prefetch_hits": table.prefetch_hits,
                              "prefetch_misses": table.prefetch_misses, **comm_totals}
        if tracker:
            tracker.log_metrics(scores, state.step)
            if timeline_png:
                tracker.log_artifact(timeline_png)
            _log_artifacts(tracker, cfg, shards, history, out, model)
            result["mlflow_unsent"] = tracker.close()
            result["mlflow_run_id"] = tracker.run_id
        write_json(os.path.join(out, "result.json"), result)
    distributed.barrier()
    return result


class _LazyEval:
    """The evaluation users, loaded on first use (rank 0 only evaluates)."""

    def __init__(self, shards: ShardSet, cfg: Config):
        self.shards, self.cfg, self.data = shards, cfg, None

    def get(self) -> EvalData:
        if self.data is None:
            self.data = EvalData(self.shards.eval_path, self.shards.num_items, self.cfg.model.max_len, self.cfg.eval)
        return self.data


def _flush_window(window, history, tracker, gcomm, step: int, steps_total: int, epoch: int, topo,
                  over: bool, proposal: float, ft) -> tuple[bool, float]:
    """Gather the window's per-rank records (collective), log them from rank 0.

    Returns (stop: any rank is over its time budget, rank 0's proposal).
    """
    per_rank, stop, proposal = metrics.gather_times(window, over, proposal)
    comm = gcomm.window_metrics()           # collective as well: bubble accounting of training/comm
    cross = ft.window_metrics()             # across replica groups (ftcore's pace figures)
    if topo.is_main:
        summary = {**metrics.summarize(window, per_rank), **comm, **cross}
        if "ft/bubble_fraction" in cross:   # the job's: inside the group, then across groups
            summary["train/bubble_fraction"] = 1.0 - (1.0 - summary["train/bubble_fraction"]) * (
                1.0 - cross["ft/bubble_fraction"])
        history.add(window, per_rank)
        if tracker:
            tracker.log_metrics(summary, step)
        log(topo, f"step {step}/{steps_total} epoch {epoch} loss {summary['train/loss']:.4f} "
                  f"lr {summary['train/lr']:.2e} tok/s {summary['train/tokens_per_s']:.0f} "
                  f"pad {summary['train/padding_fraction']:.3f} wait {per_rank[:, :, 1].mean():.4f}s")
    return stop, proposal


def _brief(scores: dict, split: str) -> str:
    return " ".join(f"{p}/{m} {scores[f'{split}/{p}/{m}']:.4f}" for p in ("full", "sampled") for m in ("hr@10", "ndcg@10"))


def _validate(model, eval_data, cfg: Config, tracker, step: int, topo) -> dict:
    scores = {}
    if topo.is_main:
        scores = evaluate(model, eval_data.get(), cfg.eval, splits=("valid",))
        log(topo, f"step {step} valid " + _brief(scores, "valid"))
        if tracker:
            tracker.log_metrics(scores, step)
    distributed.barrier()   # the other ranks wait here, not inside the next step's all-reduce
    return scores


class _Best:
    """Rank 0's copy of the model where validation metric `metric` peaked (eval.best_metric)."""

    def __init__(self, metric: str):
        self.metric, self.value, self.step, self.state = metric, float("-inf"), -1, None

    def _value(self, scores: dict) -> float:
        if self.metric not in scores:
            raise ConfigError(f"eval.best_metric={self.metric!r} is not a validation metric; choose one of "
                              f"{', '.join(sorted(k for k in scores if k.startswith('valid/')))}")
        return scores[self.metric]

    def offer(self, scores: dict, model, step: int) -> None:
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


def _full_model(model, table, topo):
    """Collective with a sharded table: rank 0 gets a copy of the model with the whole
    table in a plain nn.Embedding (evaluation, MLflow model); the others get None."""
    if table is None:
        return model
    full = table.full_weight()
    if not topo.is_main:
        return None
    emb = torch.nn.Embedding(full.shape[0], full.shape[1], padding_idx=table.padding_idx)
    emb.weight.data.copy_(full)
    copy_ = copy.copy(model)                  # shallow: shares the dense modules, owns its item_emb
    copy_._modules = dict(model._modules)
    copy_.item_emb = emb.to(full.device)
    return copy_


def _per_rank(table) -> tuple:
    """What each rank > 0 writes into its own checkpoint file: RNG, plus the optimizer state
    of its shard when the table is sharded (rank 0's is in state.pt)."""
    return ("rng", "optimizer") if table is not None else ("rng",)


def _local_rows(state: dict, table) -> dict:
    """A checkpoint holds the full table (eval and warm start read it); keep this rank's rows."""
    if table is not None:
        lo, hi = table.row_range
        state["model"]["item_emb.weight"] = state["model"]["item_emb.weight"][lo:hi].clone()
    return state


def _meta(state: TrainState, cfg: Config, shards: ShardSet, topo, tracker, ft=None) -> dict:
    """A checkpoint's meta.json: for people, `training eval`, warm start and resume."""
    return {"mlflow_run_id": tracker.run_id if tracker else None,
            "step": state.step, "epoch": state.cursor.epoch, "index": state.cursor.index,
            "config": cfg.to_dict(), "num_items": shards.num_items,
            "fingerprint": shards.fingerprint(), "shards": os.path.abspath(shards.path),
            "ranks_per_group": topo.group_size, "replica_groups": topo.num_replica_groups,
            **(ft.state_for_checkpoint() if ft is not None else {})}   # ftcore: make-up work owed


def _save(state: TrainState, cfg: Config, shards: ShardSet, topo, root: str, tracker, table=None,
          ft=None) -> str:
    meta = _meta(state, cfg, shards, topo, tracker, ft)
    sd = state.state_dict()
    if table is not None:   # collective: the checkpoint's model is the full table, as with a replicated one
        sd["model"]["item_emb.weight"] = table.full_weight()
        meta["embedding"] = "sharded"
    return checkpoint.save(root, sd, meta, rank=topo.rank, keep=cfg.train.keep_checkpoints, per_rank=_per_rank(table))


def _log_artifacts(tracker: Tracker, cfg: Config, shards: ShardSet, history, out: str, model) -> None:
    art = os.path.join(out, "artifacts")
    os.makedirs(art, exist_ok=True)
    with open(os.path.join(art, "config.toml"), "w") as f:
        f.write(to_toml(cfg))
    tracker.log_artifact(os.path.join(art, "config.toml"))
    tracker.log_artifact(os.path.join(shards.path, "manifest.json"))
    if cfg.mlflow.plots and metrics.plot(history, os.path.join(art, "training.png")):
        tracker.log_artifact(os.path.join(art, "training.png"))
    if cfg.mlflow.log_model:
        try:
            exported = serving.export(copy.deepcopy(model).cpu().eval(), shards.path, os.path.join(art, "serving"))
        except Exception as e:  # a model torch.export cannot take must not cost the run its results
            print(f"[train] model not logged: export failed ({type(e).__name__}: {e})", flush=True)
            tracker.errors.append(f"model: export failed: {type(e).__name__}: {e}")
        else:
            tracker.log_model(exported, cfg.mlflow.register, cfg.mlflow.model_name)
