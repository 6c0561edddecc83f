"""Training and evaluation at catalogue sizes: `python benchmarks/scale_training.py`.

For each catalogue size (`--items`, default 100K and 1M; add 10,000,000 by flag), the
trainer's own step (SeqRec, the default loss: sampled softmax with 1,024 shared negatives,
the item table through its TrainerTable, gradient clipping, build_optimizer's optimizer) on
synthetic batches of `--batch` histories of 1..`--max-len` uniform item ids, side by side:
optim.item_optimizer = "adam" (dense) and "rowwise_adam" (touched rows only), each in its
own process (its peak RSS is its own), one after the other per size. Then full-ranking
evaluation of `--eval-users` users against the whole catalogue (training/ranking.py, streamed
in eval.item_chunk chunks), each in its own process, interleaved: the float32 reference and
eval.precision=auto (the bf16-bounded ranker where the CPU runs bf16 natively).

Prints steps/s, tokens/s, peak RSS per size and optimizer, the rowwise/dense ratio and each
size's tokens/s against the smallest size; eval users/s per ranker and their ratio. Writes
JSON to bench-results/scale_training.json (`--json`).
"""

import argparse
import multiprocessing
import os
import resource
import sys
import time

import torch

from ftcore.util.files import atomic_write_json
from training.comm.item_table import ReplicatedItemTable, RowwiseItemTable
from training.config import EvalConfig, LossConfig, ModelConfig, OptimConfig
from training.loss import draw_negatives, loss_sum
from training.model import SeqRec
from training.ranking import make_ranker
from training.state import build_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batch(num_items: int, batch: int, max_len: int, g: torch.Generator):
    lengths = torch.randint(1, max_len + 1, (batch,), generator=g)
    offsets = torch.zeros(batch + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    values = torch.randint(1, num_items + 1, (int(offsets[-1]),), generator=g)
    labels = torch.randint(1, num_items + 1, values.shape, generator=g)
    return values, offsets, labels


def train_steps(num_items: int, optimizer: str, args) -> dict:
    """One process: build the model and optimizer at this size, time `args.steps` steps."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = SeqRec(num_items, ModelConfig(dim=args.dim, max_len=args.max_len, dropout=0.0))
    optim_cfg = OptimConfig(item_optimizer=optimizer)
    table = RowwiseItemTable(model.item_emb) if optimizer == "rowwise_adam" else ReplicatedItemTable()
    opt = build_optimizer(model, optim_cfg)
    build_s = time.perf_counter() - t0
    loss_cfg, g = LossConfig(), torch.Generator().manual_seed(1)
    params = list(model.parameters())
    tokens, elapsed = 0, 0.0
    for step in range(args.warmup + args.steps):
        values, offsets, labels = _batch(num_items, args.batch, args.max_len, g)
        t = time.perf_counter()
        negatives = draw_negatives(num_items, loss_cfg, labels, g)
        h = model(values, offsets)
        (loss_sum(model, h, labels, loss_cfg, negatives=negatives) / len(values)).backward()
        table.finish_grads()
        table.clip_grads_(params, optim_cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= args.warmup:
            elapsed += time.perf_counter() - t
            tokens += len(values)
    return {
        "steps_per_s": args.steps / elapsed,
        "tokens_per_s": tokens / elapsed,
        "build_s": build_s,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def eval_users(num_items: int, precision: str, args) -> dict:
    """One process: full ranking of `args.eval_users` users (histories excluded) at this size,
    by the ranker eval.precision picks (training/ranking.py); the first batch also pays the
    bf16 ranker's one-time setup (a pass over the table, float32 kernel checks)."""
    torch.set_num_threads(args.eval_threads or os.cpu_count() or 1)
    torch.manual_seed(0)
    model = SeqRec(num_items, ModelConfig(dim=args.dim, max_len=args.max_len, dropout=0.0)).eval()
    g, cfg = torch.Generator().manual_seed(2), EvalConfig()
    ranker = make_ranker(model, num_items, cfg.item_chunk, precision, torch.device("cpu"))
    bs = min(cfg.batch_size, args.eval_users)
    times: list[float] = []
    with torch.no_grad():
        while len(times) * bs < args.eval_users:
            values, offsets, _ = _batch(num_items, bs, args.max_len, g)
            target = torch.randint(1, num_items + 1, (bs,), generator=g)
            negatives = torch.randint(1, num_items + 1, (bs, cfg.num_negatives), generator=g)
            rows = torch.repeat_interleave(torch.arange(bs), offsets[1:] - offsets[:-1])
            t = time.perf_counter()
            h = model.last_hidden(values, offsets)
            ranker.rank(h, target, negatives, (rows, values))
            times.append(time.perf_counter() - t)
    users = len(times) * bs
    counts = getattr(ranker, "counts", {})
    return {
        "ranker": type(ranker).__name__,
        "users_per_s": users / sum(times),
        "steady_users_per_s": bs * (len(times) - 1) / sum(times[1:]) if len(times) > 1 else None,
        "first_batch_s": times[0],
        "users": users,
        "threads": torch.get_num_threads(),
        "band_items_per_user": counts.get("band_pairs", 0) / users,
        "reference_batches": counts.get("plain_batches", 0),
        "item_chunk": cfg.item_chunk,
        "batch_size": bs,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def _in_child(fn, *a) -> dict:
    """fn(*a) in a fresh spawned process: its peak RSS is its own."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, a)


def run(args) -> dict:
    res: dict = {"train": {}, "eval": {}}
    for n in args.items:
        if not args.eval_only:
            res["train"][n] = {opt: _in_child(train_steps, n, opt, args) for opt in ("adam", "rowwise_adam")}
        if args.eval_users:
            # the float32 reference and eval.precision=auto, interleaved: the auto run is the row's
            # figure (scale.py's table), the reference beside it
            runs: dict[str, list[dict]] = {"fp32": [], "auto": []}
            for _ in range(args.eval_repeats):
                for precision in runs:
                    runs[precision].append(_in_child(eval_users, n, precision, args))
            best = {p: max(r, key=lambda x: x["users_per_s"]) for p, r in runs.items()}
            res["eval"][n] = {**best["auto"], "fp32": best["fp32"], "runs": runs}
            res["eval"][n]["vs_fp32"] = best["auto"]["users_per_s"] / best["fp32"]["users_per_s"]
        print(f"  {n:>10,} items done", flush=True)
    return res


def report(res: dict, items: list[int]) -> None:
    if res["train"]:
        _report_train(res, items)
    if res["eval"]:
        _report_eval(res)


def _report_train(res: dict, items: list[int]) -> None:
    base = res["train"][items[0]]
    head = ("items", "optimizer", "steps/s", "tokens/s", "peak RSS", "vs dense", f"vs {items[0]:,}")
    print("\n{:>11} {:>13} {:>8} {:>9} {:>9} {:>9} {:>12}".format(*head))
    for n in items:
        r = res["train"][n]
        for opt in ("adam", "rowwise_adam"):
            x = r[opt]
            dense, small = x["tokens_per_s"] / r["adam"]["tokens_per_s"], x["tokens_per_s"] / base[opt]["tokens_per_s"]
            print(
                f"{n:>11,} {opt:>13} {x['steps_per_s']:>8.2f} {x['tokens_per_s']:>9.0f} "
                f"{x['peak_rss_gb']:>7.2f}GB {dense:>8.2f}x {small:>11.2f}x"
            )


def _report_eval(res: dict) -> None:
    head = ("items", "ranker", "users/s", "steady", "1st batch", "band/user", "peak RSS")
    print("\n{:>11} {:>15} {:>8} {:>7} {:>9} {:>9} {:>9}".format(*head))
    for n, e in res["eval"].items():
        for x in (e["fp32"], e):
            steady = f"{x['steady_users_per_s']:.0f}" if x["steady_users_per_s"] else "-"
            print(
                f"{n:>11,} {x['ranker']:>15} {x['users_per_s']:>8.0f} {steady:>7} {x['first_batch_s']:>8.2f}s "
                f"{x['band_items_per_user']:>9.0f} {x['peak_rss_gb']:>7.2f}GB"
            )
        print(f"{'':>11} {'auto / fp32':>15} {e['vs_fp32']:>7.2f}x  ({e['threads']} threads)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", default="100000,1000000", help="catalogue sizes, comma-separated (10000000 by flag)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per size and optimizer")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--batch", type=int, default=256, help="histories per step")
    p.add_argument("--max-len", type=int, default=50, help="longest history; lengths uniform 1..max-len")
    p.add_argument("--dim", type=int, default=64, help="model.dim")
    p.add_argument("--eval-users", type=int, default=512, help="users ranked per size; 0: no evaluation")
    p.add_argument("--threads", type=int, default=1, help="torch threads per training process")
    p.add_argument("--eval-threads", type=int, default=0, help="torch threads per evaluation process; 0: all cores")
    p.add_argument("--eval-repeats", type=int, default=1, help="fp32 / auto evaluation pairs per size (best kept)")
    p.add_argument("--eval-only", action="store_true", help="no training steps: evaluation only")
    p.add_argument("--json", default=os.path.join(ROOT, "bench-results", "scale_training.json"))
    args = p.parse_args(argv)
    args.items = [int(x) for x in args.items.split(",")]
    res = run(args)
    report(res, args.items)
    atomic_write_json(
        args.json, {"argv": sys.argv, "args": {k: v for k, v in vars(args).items()}, "results": res}, indent=1
    )
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
