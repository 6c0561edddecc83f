"""Training benchmarks: `python benchmarks/training_bench.py [--part quality|throughput|window|all]`.

- quality: on shared/data beauty and video, the default config trained for at most
  `--minutes` per dataset; test HR@10 / NDCG@10 under the full and sampled protocols
  next to the published rows of shared/data/README.md and our own most-popular floor.
- throughput: non-padding tokens/s of the same model on (a) balanced shards (dataprep
  default), (b) randomly assigned shards, (c) a padded-batch implementation (every
  batch padded to max_len, random shards, as a conventional SASRec pipeline does),
  interleaved round by round in one run; ratios against (c).
- window: dataprep's window K (steps sorted by cost together): K=1 (random batches)
  against the default K, same short training budget, quality and padding.
- hstu: SASRec and HSTU (relative attention bias on, the default) at the same wall-clock
  budget (`--minutes` each) on each dataset: beauty and video (no timestamps: HSTU's
  positional buckets only) and `synth-long`, synthetic events with timestamps and long
  histories (median ~200, cap 1,024) where attention dominates. The two train at the same
  time, one process and one thread each, so both see the same load of a shared machine (one
  after the other, a load change between them decided the result).

Prints a table per part and writes JSON to bench-results/training-<part>.json.
"""

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from dataprep import schema
from dataprep.build import build_shards
from dataprep.settings import ShardSettings
from ftcore.util.files import atomic_write_json
from training.checkpoint_key import use_default
from training.config import EvalConfig, load_config
from training.evaluate import EvalData, MostPopular, evaluate
from training.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
DATASETS = {"beauty": ("beauty.txt", "iclrec"), "video": ("video.txt", "sasrec")}
# shared/data/README.md: (sampled HR@10, NDCG@10), (full HR@10, NDCG@10)
Pair = tuple[float, float]
PUBLISHED: dict[str, dict[str, tuple[Pair | None, Pair | None]]] = {
    "beauty": {
        "most popular": ((0.2895, 0.1499), (0.0114, 0.0053)),
        "SASRec paper": ((0.4854, 0.3219), None),
        "SASRec reproduction": ((0.4669, 0.3104), None),
        "ICLRec (history excluded)": (None, (0.0744, 0.0403)),
    },
    "video": {
        "most popular": ((0.4798, 0.2781), (0.0189, 0.0097)),
        "SASRec paper": ((0.7410, 0.5360), None),
        "SASRec reproduction": ((0.7318, 0.5308), None),
    },
}
BATCH_SIZE, MAX_LEN = 128, 50
# synth-long: lognormal lengths (median 200) capped at 1,024, Zipf items, half of the events
# the fixed successor of the previous item (a sequence to learn), times with ~1 h mean gaps
SYNTH_LONG: dict[str, Any] = {
    "users": 1500,
    "items": 5000,
    "seed": 0,
    "median_len": 200.0,
    "sigma": 1.0,
    "max_history": 1024,
    "markov": 0.5,
}
SYNTH_LONG_BATCH, SYNTH_LONG_MAX_LEN = 16, 1024


def shards_for(name: str, work: str, window_steps: int | None = None, world_size: int = 1) -> str:
    if name == "synth-long":
        from dataprep.synth import write_synthetic

        path = os.path.join(work, "synth-long.parquet")
        if not os.path.isfile(path):
            write_synthetic(path, fmt="events", **SYNTH_LONG)
        out = os.path.join(work, f"synth-long-w{world_size}")
        settings = ShardSettings(
            world_size=world_size, batch_size=SYNTH_LONG_BATCH, max_len=SYNTH_LONG_MAX_LEN, window_steps=window_steps
        )
        build_shards(path, "events", out, settings)
        return out
    fname, fmt = DATASETS[name]
    path = os.path.join(DATA, fname)
    if not os.path.isfile(path):
        sys.exit(f"error: {path} not found (the shared datasets live in <project root>/../shared/data)")
    out = os.path.join(work, f"{name}-w{world_size}-k{window_steps or 'default'}")
    settings = ShardSettings(world_size=world_size, batch_size=BATCH_SIZE, max_len=MAX_LEN, window_steps=window_steps)
    build_shards(path, fmt, out, settings)
    return out


def randomize(src: str, dst: str, seed: int = 0) -> str:
    """A copy of a shard set with samples assigned to (step, rank) uniformly at random.

    Same samples, same steps and ranks, the same number of samples per step as the
    source, so only the assignment differs (the 'random' baseline of balancing).
    """
    m = json.load(open(os.path.join(src, schema.MANIFEST)))
    W, steps = m["config"]["world_size"], m["steps"]
    rows = pa.concat_tables(pq.read_table(os.path.join(src, schema.shard_file(r))) for r in range(W))
    rows = rows.take(np.random.default_rng(seed).permutation(len(rows)))
    per_step = np.full(steps, len(rows) // steps)
    per_step[: len(rows) % steps] += 1
    step_of = np.repeat(np.arange(steps), per_step)
    within = np.arange(len(rows)) - np.repeat(np.cumsum(per_step) - per_step, per_step)
    rank_of = (within * W // np.repeat(per_step, per_step)).astype(np.int32)
    rows = rows.set_column(rows.schema.get_field_index("step"), "step", pa.array(step_of.astype(np.int32)))
    rows = rows.set_column(rows.schema.get_field_index("rank"), "rank", pa.array(rank_of))
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("rank-*.parquet"))
    for r in range(W):
        part = rows.filter(pc.equal(rows.column("rank"), r))
        with pq.ParquetWriter(os.path.join(dst, schema.shard_file(r)), part.schema) as w:
            steps_col = part.column("step").to_numpy()
            for s in range(steps):
                w.write_table(part.filter(pa.array(steps_col == s)))
    m["config"]["method"] = "random (benchmarks/training_bench.py)"
    with open(os.path.join(dst, schema.MANIFEST), "w") as f:
        json.dump(m, f, indent=1)
    return dst


def _row(name, sampled, full):
    f = lambda p: f"{p[0]:.4f} / {p[1]:.4f}" if p else "n/a"  # noqa: E731
    return f"| {name} | {f(sampled)} | {f(full)} |"


def quality(args) -> dict:
    results = {}
    for name in args.datasets:
        shards = shards_for(name, args.work)
        data = EvalData(
            os.path.join(shards, schema.EVAL_FILE),
            json.load(open(os.path.join(shards, schema.MANIFEST)))["num_items"],
            MAX_LEN,
            EvalConfig(),
        )
        t = time.perf_counter()
        pop = evaluate(MostPopular(data), data, EvalConfig(), splits=("test",))
        pop_s = time.perf_counter() - t
        steps = json.load(open(os.path.join(shards, schema.MANIFEST)))["steps"]
        overrides = [
            f"data.shards={shards}",
            f"train.out={os.path.join(args.work, 'quality-' + name)}",
            f"train.max_minutes={args.minutes}",
            f"train.eval_every={2 * steps}",
            *args.set,
        ]
        cfg = load_config(args.config, overrides)
        t = time.perf_counter()
        res = train(cfg)
        wall = time.perf_counter() - t
        m = res["metrics"]
        results[name] = {
            "test": m,
            "most_popular_test": pop,
            "wall_s": wall,
            "train_s": res["train_seconds"],
            "epochs": res["epochs_completed"],
            "steps": res["steps"],
            "throughput": res["throughput"],
            "most_popular_eval_s": pop_s,
            "config": cfg.to_dict(),
        }
        print(
            f"\n### {name}: {res['epochs_completed']:.1f} epochs, {res['train_seconds'] / 60:.1f} min training, "
            f"{wall / 60:.1f} min wall (incl. validation and test)\n"
        )
        print("| model | sampled HR@10 / NDCG@10 | full HR@10 / NDCG@10 |\n|---|---|---|")
        for row, (sampled, full) in PUBLISHED[name].items():
            print(_row(f"{row} (published)", sampled, full))
        print(
            _row(
                "most popular (ours)",
                (pop["test/sampled/hr@10"], pop["test/sampled/ndcg@10"]),
                (pop["test/full/hr@10"], pop["test/full/ndcg@10"]),
            )
        )
        print(
            _row(
                f"ftrec {cfg.model.attention}, {cfg.loss.kind}",
                (m["test/sampled/hr@10"], m["test/sampled/ndcg@10"]),
                (m["test/full/hr@10"], m["test/full/ndcg@10"]),
            )
        )
        rep = PUBLISHED[name]["SASRec reproduction"][0]
        assert rep is not None
        print(
            f"\nratio to SASRec reproduction (sampled): HR@10 {m['test/sampled/hr@10'] / rep[0]:.3f}, "
            f"NDCG@10 {m['test/sampled/ndcg@10'] / rep[1]:.3f}; full HR@10 vs most popular: "
            f"{m['test/full/hr@10'] / max(pop['test/full/hr@10'], 1e-9):.1f}x"
        )
    return results


def throughput(args) -> dict:
    name = args.datasets[0]
    balanced = shards_for(name, args.work, world_size=args.world_size)
    random_ = randomize(balanced, balanced + "-random")
    variants = {
        "balanced": (balanced, []),
        "random": (random_, []),
        "padded (random, pad to max_len)": (random_, ["data.pad_to_max_len=true"]),
    }
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.rounds):  # interleaved: the machine's noise hits every variant
        for v, (shards, extra) in variants.items():
            cfg = load_config(
                args.config,
                [
                    f"data.shards={shards}",
                    f"train.out={os.path.join(args.work, 'tp')}",
                    f"train.max_steps={args.steps}",
                    "train.epochs=1",
                    "mlflow.enabled=false",
                    "eval.periodic=false",
                    "eval.final=false",
                    "train.log_every=10",
                    *extra,
                    *args.set,
                ],
            )
            runs[v].append(train(cfg)["throughput"])
    base = statistics.median(r["tokens_per_s"] for r in runs["padded (random, pad to max_len)"])
    print(
        f"\n### throughput on {name}: {args.steps} steps x {args.rounds} interleaved rounds, "
        f"batch {BATCH_SIZE}, max_len {MAX_LEN}, median of rounds\n"
    )
    print("| variant | non-padding tokens/s | ratio vs padded | padding fraction | ms/step |\n|---|---|---|---|---|")
    out = {}
    for v, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        out[v] = {
            "tokens_per_s": tps,
            "ratio_vs_padded": tps / base,
            "rounds": rs,
            "padding_fraction": statistics.median(r["padding_fraction"] for r in rs),
            "step_ms": 1e3 * statistics.median(r["step_seconds"] / r["steps"] for r in rs),
        }
        print(f"| {v} | {tps:,.0f} | {tps / base:.2f} | {out[v]['padding_fraction']:.3f} | {out[v]['step_ms']:.1f} |")
    return out


def window(args) -> dict:
    name = args.datasets[0]
    out = {}
    # K=1 (random batches), the default K, and the default K with the loss normalized per
    # epoch instead of per step (sorted windows make steps of short and of long histories;
    # per-step normalization then weighs a short history's tokens more).
    for k, norm in ((1, "step"), (None, "step"), (None, "epoch")):
        shards = shards_for(name, args.work, window_steps=k)
        kk = json.load(open(os.path.join(shards, schema.MANIFEST)))["config"]["window_steps"]
        cfg = load_config(
            args.config,
            [
                f"data.shards={shards}",
                f"train.out={os.path.join(args.work, f'win-{kk}')}",
                f"train.epochs={args.window_epochs}",
                "mlflow.enabled=false",
                "eval.periodic=false",
                f"loss.normalize={norm}",
                *args.set,
            ],
        )
        res = train(cfg)
        out[f"K={kk}, loss.normalize={norm}"] = {
            "metrics": res["metrics"],
            "throughput": res["throughput"],
            "epochs": res["epochs_completed"],
        }
    print(f"\n### dataprep window K on {name}: {args.window_epochs} epochs each, default config\n")
    print("| K | valid full NDCG@10 | test full HR@10 / NDCG@10 | test sampled HR@10 / NDCG@10 | padding | tokens/s |")
    print("|---|---|---|---|---|---|")
    for label, r in out.items():
        m, t = r["metrics"], r["throughput"]
        print(
            f"| {label} | {m['valid/full/ndcg@10']:.4f} | "
            f"{m['test/full/hr@10']:.4f} / {m['test/full/ndcg@10']:.4f} | "
            f"{m['test/sampled/hr@10']:.4f} / {m['test/sampled/ndcg@10']:.4f} | {t['padding_fraction']:.3f} | "
            f"{t['tokens_per_s']:,.0f} |"
        )
    return out


def _train_summary(config: str | None, overrides: list[str]) -> dict:
    """One training run in its own process (one thread): what the hstu table needs."""
    torch.set_num_threads(1)
    cfg = load_config(config, overrides)
    res = train(cfg)
    return {
        "test": res["metrics"],
        "epochs": res["epochs_completed"],
        "steps": res["steps"],
        "train_s": res["train_seconds"],
        "throughput": res["throughput"],
        "config": cfg.to_dict(),
    }


def hstu(args) -> dict:
    """SASRec vs HSTU, same data, same settings but model.attention, same training minutes, run together."""
    out = {}
    for name in args.datasets:
        shards = shards_for(name, args.work)
        m = json.load(open(os.path.join(shards, schema.MANIFEST)))
        # synth-long: [B, 1024, 1024] attention in eval; steps of seconds, and the trainer checks
        # its time budget every log_every steps
        extra = ["eval.batch_size=32", "train.log_every=2"] if name == "synth-long" else []
        with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {
                kind: pool.submit(
                    _train_summary,
                    args.config,
                    [
                        f"data.shards={shards}",
                        f"train.out={os.path.join(args.work, f'vs-{name}-{kind}')}",
                        f"train.max_minutes={args.minutes}",
                        "eval.periodic=false",
                        "mlflow.enabled=false",
                        f"model.attention={kind}",
                        *extra,
                        *args.set,
                    ],
                )
                for kind in ("sasrec", "hstu")
            }
            runs = {kind: f.result() for kind, f in futures.items()}
        out[name] = {"timestamps": m["format_version"] == 2, "runs": runs}
    keys = [
        ("full HR@10", "test/full/hr@10"),
        ("full NDCG@10", "test/full/ndcg@10"),
        ("sampled HR@10", "test/sampled/hr@10"),
        ("sampled NDCG@10", "test/sampled/ndcg@10"),
    ]
    print(f"\n### SASRec vs HSTU (relative attention bias), {args.minutes} min of training each, test split\n")
    print("| data | times | model | " + " | ".join(k for k, _ in keys) + " | tokens/s | epochs |")
    print("|---|---|---|" + "---|" * (len(keys) + 2))
    for name, r in out.items():
        a, b = r["runs"]["sasrec"], r["runs"]["hstu"]
        for kind, x in (("SASRec", a), ("HSTU", b)):
            print(
                f"| {name} | {'yes' if r['timestamps'] else 'no'} | {kind} | "
                + " | ".join(f"{x['test'][k]:.4f}" for _, k in keys)
                + f" | {x['throughput']['tokens_per_s']:,.0f} | {x['epochs']:.2f} |"
            )
        print(
            f"| {name} | | **HSTU / SASRec** | "
            + " | ".join(f"**{b['test'][k] / max(a['test'][k], 1e-12):.3f}**" for _, k in keys)
            + f" | **{b['throughput']['tokens_per_s'] / a['throughput']['tokens_per_s']:.2f}** | |"
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/training_bench.py", description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["quality", "throughput", "window", "hstu", "all"], default="all")
    p.add_argument("--datasets", default="beauty,video", help="comma-separated: beauty, video, synth-long")
    p.add_argument("--minutes", type=float, default=15.0, help="training budget per dataset (quality)")
    p.add_argument("--steps", type=int, default=40, help="steps per variant and round (throughput)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (throughput)")
    p.add_argument("--world-size", type=int, default=1, help="shard world size for throughput (one process reads all)")
    p.add_argument("--window-epochs", type=int, default=6, help="epochs per K (window)")
    p.add_argument("--config", help="TOML config (default: the trainer's defaults)")
    p.add_argument("--set", nargs="*", default=[], help="config overrides section.key=value")
    p.add_argument("--work", default=os.path.join(ROOT, "bench-results", "work"))
    p.add_argument("--results", default=os.path.join(ROOT, "bench-results"))
    args = p.parse_args(argv)
    args.datasets = [d for d in args.datasets.split(",") if d]
    torch.set_num_threads(1)
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.results, exist_ok=True)
    use_default(args.work)  # the checkpoint key (FTREC_CHECKPOINT_KEY_FILE), unless one is set
    parts = ["quality", "throughput", "window", "hstu"] if args.part == "all" else [args.part]
    for part in parts:
        res = {"quality": quality, "throughput": throughput, "window": window, "hstu": hstu}[part](args)
        path = os.path.join(args.results, f"training-{part}.json")
        atomic_write_json(path, {"argv": sys.argv, "results": res}, indent=1, default=str)
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
