"""A toy data-parallel trainer on ftcore: the whole FT-HSDP step protocol on a tiny MLP.

Used by ftcore's integration tests and benchmarks so they depend on nothing but torch:
synthetic "shards" (shard s, row group r -> a seeded batch with sample ids
s * S * B + r * B + i), a replicated MakeupSchedule, a ledger, the manager, and at
the end the group's parameters and optimizer state in OUT/replica_<g>/state.safetensors.

    FTCORE_LIGHTHOUSE=... FTREC_REPLICA_GROUP=g FTREC_NUM_REPLICA_GROUPS=R \
        python -m ftcore.examples.toy --out DIR --steps 20 --epochs 1
"""

import argparse
import datetime
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist

from ftcore import collectives as coll
from ftcore import ledger as ledger_mod
from ftcore import manager as manager_mod
from ftcore import tensorfile
from ftcore.lighthouse_client import JobFinished, Replaced
from ftcore.schedule import MakeupSchedule


def batch(shard: int, row_group: int, steps: int, size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(shard * 100_003 + row_group)
    x = torch.randn(size, dim, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    first = (shard * steps + row_group) * size
    return x, y, list(range(first, first + size))


def sample_ids(shard: int, row_group: int, steps: int, size: int) -> list[int]:
    first = (shard * steps + row_group) * size
    return list(range(first, first + size))


def state_checksum(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftcore.examples.toy")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20, help="steps (row groups) per epoch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (pace the run)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="write OUT/checkpoint.safetensors every N steps and resume from it at start "
                        "(the restart-everything baseline of the benchmark)")
    a = p.parse_args(argv)
    t_main = time.time()
    torch.set_num_threads(1)

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    if world > 1:
        coll.setup_default()
    cfg = manager_mod.config_from_env()
    g, R, K = cfg.group, cfg.num_groups, cfg.world
    shard = g * K + rank
    os.makedirs(os.path.join(a.out, "records"), exist_ok=True)
    cfg.records = cfg.records or os.path.join(a.out, "records", f"group-{g}-rank-{rank}-inc-{{incarnation}}.jsonl")

    torch.manual_seed(0)  # the same initial model on every group and rank
    model = torch.nn.Sequential(torch.nn.Linear(a.dim, a.dim), torch.nn.ReLU(), torch.nn.Linear(a.dim, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = MakeupSchedule(a.steps, R, a.epochs)
    params = list(model.parameters())
    for prm in params:
        prm.grad = torch.zeros_like(prm)
    opt.step()  # materialize optimizer state so every group's state has the same structure
    opt.zero_grad(set_to_none=False)

    def state_dict():
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "schedule": sched.state_dict()}

    def load_state_dict(st):
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["schedule"])

    ckpt = os.path.join(a.out, "checkpoint.safetensors")
    start_step = 0
    if a.checkpoint_every and os.path.exists(ckpt):
        st, meta = tensorfile.read(open(ckpt, "rb"))
        load_state_dict(st)
        start_step = int(meta["step"])
    mgr = manager_mod.Manager(cfg, state_dict, load_state_dict,
                              group_pg=dist.group.WORLD if world > 1 else None, step=start_step,
                              faults=manager_mod.faults_from_env())
    ledger = ledger_mod.Ledger(os.path.join(a.out, "ledger"), g, rank)
    print(f"toy: group {g}/{R} rank {rank}/{K} incarnation {cfg.incarnation} started (main at {t_main:.3f}, ready at {time.time():.3f})", flush=True)
    try:
        while not sched.done:
            mgr.start_quorum()
            # Every rank of the group runs the same collectives in every branch below.
            q = mgr.wait_quorum()
            healing = q is not None and mgr.healing
            live = set(q["groups"]) - {int(h) for h in q["heal"]} if q is not None else set()
            pos = sched.position(live) if q is not None else None
            if q is not None and pos is None and not healing:
                time.sleep(0.05)   # only absent groups' make-up work is left: wait for them
            works = pos is not None and not healing and sched.works(pos, g)
            if a.step_sleep:
                time.sleep(a.step_sleep)
            opt.zero_grad(set_to_none=False)
            if works:
                x, y, _ = batch(shard, pos.row_group, a.steps, a.batch, a.dim)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
            if world > 1:
                for prm in params:
                    coll.all_reduce(prm.grad, kind=coll.DATA)
                    prm.grad.div_(world)
            mgr.set_work(works)

            def same_batch(q2, pos=pos):   # a peer failed the exchange: is this still our batch there?
                return pos is not None and sched.position(set(q2["groups"]) - {int(h) for h in q2["heal"]}) == pos
            mgr.allreduce([prm.grad for prm in params], same_batch=same_batch)
            if mgr.quorum is not None and mgr.quorum is not q:   # re-run in the survivors' quorum
                q = mgr.quorum
                live = set(q["groups"]) - {int(h) for h in q["heal"]}
            commit = mgr.should_commit()
            if mgr.healed_step is not None:
                ledger.healed(mgr.healed_step)
            if commit:
                if healing:    # the schedule just arrived with the state
                    pos = sched.position(live)
                assert pos is not None
                contributors = {h for h in live if sched.works(pos, h)}
                if len(contributors) != mgr.contributors:
                    raise RuntimeError(f"schedule disagrees with FTAR: {sorted(contributors)} vs {mgr.contributors}")
                scale = mgr.lr_scale()
                for pg_ in opt.param_groups:
                    pg_["lr"] = 1e-2 * scale
                opt.step()
                ledger.record(mgr.step - 1, pos.epoch, pos.row_group, pos.kind, contributors, q["quorum_id"],
                              sample_ids(shard, pos.row_group, a.steps, a.batch) if g in contributors else None)
                sched.commit(pos, contributors)
                if a.checkpoint_every and mgr.step % a.checkpoint_every == 0 and g == min(live) and rank == 0:
                    tensorfile.save(state_dict(), ckpt, {"step": str(mgr.step)})
            for prm in params:
                prm.grad.zero_()
    except JobFinished as e:
        print(f"toy: {e}; exiting", flush=True)
        mgr.shutdown(leave=False)
        return 0
    except Replaced as e:
        print(f"toy: {e}; exiting", flush=True)
        return 3
    final = os.path.join(a.out, f"replica_{g}")
    os.makedirs(final, exist_ok=True)
    if rank == 0:
        path = os.path.join(final, "state.safetensors")
        tensorfile.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path,
                        {"step": str(mgr.step)})
        print(f"toy: group {g} finished at step {mgr.step} checksum {state_checksum(path)}", flush=True)
    if world > 1:
        coll.barrier()
    mgr.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
