"""A toy data-parallel trainer on ftcore: the whole FT-HSDP step protocol on a tiny MLP.

The long form: docs/ftcore.md, "ftcore/examples/toy"."""

import argparse
import datetime
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ftcore import collectives as coll
from ftcore import environment, final_state, tensorfile
from ftcore.ledger import Ledger
from ftcore.lighthouse_client import JobFinished, Replaced
from ftcore.manager import Manager, config_from_env, faults_from_env
from ftcore.messages import Quorum
from ftcore.schedule import MakeupSchedule, Position


def batch(shard: int, row_group: int, size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded batch of (shard, row group): inputs and targets."""
    g = torch.Generator().manual_seed(shard * 100_003 + row_group)
    x = torch.randn(size, dim, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def sample_ids(shard: int, row_group: int, steps: int, size: int) -> list[int]:
    """The sample ids of that batch (what the ledger records and its check expects)."""
    first = (shard * steps + row_group) * size
    return list(range(first, first + size))


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ftcore.examples.toy")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20, help="steps (row groups) per epoch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (pace the run)")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="write OUT/checkpoint.safetensors every N steps and resume from it at start "
        "(the restart-everything baseline of the benchmark)",
    )
    return p.parse_args(argv)


@dataclass
class Toy:
    """One rank's model, optimizer and replicated make-up schedule."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: MakeupSchedule
    params: list[torch.nn.Parameter]

    @classmethod
    def build(cls, a: argparse.Namespace, num_groups: int) -> "Toy":
        torch.manual_seed(0)  # the same initial model on every group and rank
        model = torch.nn.Sequential(torch.nn.Linear(a.dim, a.dim), torch.nn.ReLU(), torch.nn.Linear(a.dim, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        params = list(model.parameters())
        for prm in params:
            prm.grad = torch.zeros_like(prm)
        opt.step()  # materialize optimizer state so every group's state has the same structure
        opt.zero_grad(set_to_none=False)
        return cls(model, opt, MakeupSchedule(a.steps, num_groups, a.epochs), params)

    def grads(self) -> list[torch.Tensor]:
        return [prm.grad for prm in self.params if prm.grad is not None]

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "schedule": self.sched.state_dict(),
        }

    def load_state_dict(self, st: dict) -> None:
        self.model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["optimizer"])
        self.sched.load_state_dict(st["schedule"])


@dataclass
class Run:
    """Where this process runs: its group's manager and ledger, its shard, its files."""

    a: argparse.Namespace
    mgr: Manager
    ledger: Ledger
    rank: int
    world: int
    ckpt: str

    def shard_of(self, group: int) -> int:
        """The shard this rank reads for `group`'s data (its own, or a make-up piece's owner's)."""
        return group * self.world + self.rank


def _step(r: Run, toy: Toy) -> None:
    """One step of the protocol: quorum, this group's batch (or none), FTAR, the vote."""
    mgr, g = r.mgr, r.mgr.cfg.group
    mgr.start_quorum()
    # Every rank of the group runs the same collectives in every branch below.
    q = mgr.wait_quorum()
    healing = q is not None and mgr.healing
    live = q.live() if q is not None else set()
    pos = toy.sched.position(live) if q is not None else None
    if q is not None and pos is None and not healing:
        time.sleep(0.05)  # the data is done: waiting for every group to be back
    piece = pos.piece(g) if pos is not None and g in live else None  # none: healing, or aside as a source
    works = piece is not None
    if r.a.step_sleep:
        time.sleep(r.a.step_sleep)
    toy.opt.zero_grad(set_to_none=False)
    if piece is not None:  # (owner, epoch, row group): a make-up piece may be another group's
        x, y = batch(r.shard_of(piece[0]), piece[2], r.a.batch, r.a.dim)
        loss = torch.nn.functional.mse_loss(toy.model(x), y)
        loss.backward()
    if r.world > 1:
        for grad in toy.grads():
            coll.all_reduce(grad, kind=coll.DATA)
            grad.div_(r.world)
    mgr.set_work(works)

    def same_batch(q2: Quorum) -> bool:  # a peer failed the exchange: is this still our batch there?
        return pos is not None and toy.sched.position(q2.live()) == pos

    mgr.allreduce(toy.grads(), same_batch=same_batch)
    if mgr.quorum is not None and mgr.quorum is not q:  # re-run in the survivors' quorum
        q = mgr.quorum
        live = q.live()
    commit = mgr.should_commit()
    if mgr.healed_step is not None:
        r.ledger.healed(mgr.healed_step)
    if commit and q is not None:
        _commit(r, toy, q, live, toy.sched.position(live) if healing else pos)  # healed: the schedule just came
    for grad in toy.grads():
        grad.zero_()


def _commit(r: Run, toy: Toy, q: Quorum, live: set[int], pos: Position | None) -> None:
    """Apply the averaged update, record the step in the ledger and the schedule."""
    mgr, g = r.mgr, r.mgr.cfg.group
    if pos is None:
        raise RuntimeError("a committed step has no place in the make-up schedule")
    contributors = {h for h in live if toy.sched.works(pos, h)}
    if len(contributors) != mgr.contributors:
        raise RuntimeError(f"schedule disagrees with FTAR: {sorted(contributors)} vs {mgr.contributors}")
    scale = mgr.lr_scale()
    for param_group in toy.opt.param_groups:
        param_group["lr"] = 1e-2 * scale
    toy.opt.step()
    piece = pos.piece(g)
    r.ledger.record(
        mgr.step - 1,
        pos.epoch,
        pos.row_group,
        pos.kind,
        contributors,
        q.quorum_id,
        sample_ids(r.shard_of(piece[0]), piece[2], r.a.steps, r.a.batch) if piece and g in contributors else None,
        pieces=pos.pieces,
    )
    toy.sched.commit(pos, contributors)
    if r.a.checkpoint_every and mgr.step % r.a.checkpoint_every == 0 and g == min(live) and r.rank == 0:
        tensorfile.save(toy.state_dict(), r.ckpt, {"step": str(mgr.step)})


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    t_main = time.time()
    torch.set_num_threads(1)

    told = environment.RankEnv.from_env()
    rank, world = told.rank or 0, 1 if told.world is None else told.world
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    if world > 1:
        coll.setup_default()
    cfg = config_from_env()
    g, R, K = cfg.group, cfg.num_groups, cfg.world
    os.makedirs(os.path.join(a.out, "records"), exist_ok=True)
    cfg.records = cfg.records or os.path.join(a.out, "records", f"group-{g}-rank-{rank}-inc-{{incarnation}}.jsonl")

    toy = Toy.build(a, R)
    ckpt = os.path.join(a.out, "checkpoint.safetensors")
    start_step = 0
    if a.checkpoint_every and os.path.exists(ckpt):
        with open(ckpt, "rb") as f:
            st, meta = tensorfile.read(f)
        toy.load_state_dict(st)
        start_step = int(meta["step"])
    mgr = Manager(
        cfg,
        toy.state_dict,
        toy.load_state_dict,
        group_pg=dist.group.WORLD if world > 1 else None,
        step=start_step,
        faults=faults_from_env(),
    )
    r = Run(a, mgr, Ledger(os.path.join(a.out, "ledger"), g, rank), rank, world, ckpt)
    print(
        f"toy: group {g}/{R} rank {rank}/{K} incarnation {cfg.incarnation} started "
        f"(main at {t_main:.3f}, ready at {time.time():.3f})",
        flush=True,
    )
    try:
        while not toy.sched.finished():
            _step(r, toy)
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
        path = os.path.join(final, final_state.file_name(0))
        tensorfile.save(
            {"model": toy.model.state_dict(), "optimizer": toy.opt.state_dict()}, path, {"step": str(mgr.step)}
        )
        print(f"toy: group {g} finished at step {mgr.step} checksum {final_state.checksum(path)}", flush=True)
    if world > 1:
        coll.barrier()
    mgr.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
