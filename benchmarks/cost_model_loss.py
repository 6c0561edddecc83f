"""What the shard balance loses when its cost model was timed with another loss (issue #39).

    python benchmarks/cost_model_loss.py [--dataset beauty] [--world-size 2] [--batch-size 128] [--json PATH]

The trainer's default loss (loss.kind = auto) is the full softmax over the catalogue when it
has at most 32,768 items; training/calibrate.py still times its probe with 256 shared sampled
negatives, so the shards are balanced by the cost of a loss that does not run. On one thread
of this machine, with the default model and the dataset's catalogue size, this times c(L) both
ways (the calibrate probe, and the probe with every item's score), then balances the dataset's
samples (dataprep.balance.plan, the build's own planner) by each model and scores both plans,
and random shards, by the full softmax's c(L), the cost that runs: per-step imbalance (max /
mean rank cost) and the bubble fraction. Prints a table; JSON to bench-results/cost_model_loss.json.
"""

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DATA = ROOT.parent / "shared" / "data"
FILES = {"beauty": ("beauty.txt", "iclrec"), "video": ("video.txt", "sasrec")}
MAX_LEN = 50


def full_softmax_probe(cfg, num_items: int):
    """training.calibrate.probe's step with the loss the trainer runs here: every item scored."""
    import torch

    from training.model import SeqRec

    def make(length: int, batch: int):
        torch.manual_seed(0)
        model = SeqRec(num_items, dataclasses.replace(cfg, max_len=max(cfg.max_len, length)))
        values = torch.randint(1, num_items + 1, (batch * length,))
        offsets = torch.arange(0, batch * length + 1, length)
        every = torch.arange(1, num_items + 1)

        def step() -> None:
            model.scores(model(values, offsets), every).logsumexp(-1).mean().backward()

        return step

    return make


def lengths_and_items(dataset: str, world_size: int, batch_size: int, tmp: Path) -> tuple[np.ndarray, int]:
    """The training samples' history lengths and the catalogue size of the dataset's shard set."""
    from dataprep.build import build_shards
    from dataprep.settings import ShardSettings

    name, fmt = FILES[dataset]
    out = tmp / "shards"
    settings = ShardSettings(world_size=world_size, batch_size=batch_size, max_len=MAX_LEN)
    m = build_shards(str(DATA / name), fmt, str(out), settings)
    lengths = [pq.read_table(f, columns=["length"]).column("length").to_numpy() for f in sorted(out.glob("shards/*"))]
    return np.concatenate(lengths), int(m["num_items"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", choices=sorted(FILES), default="beauty")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--json", default=str(ROOT / "bench-results" / "cost_model_loss.json"))
    a = p.parse_args(argv)

    from dataprep import balance
    from dataprep.cost import calibrate
    from training import calibrate as cal
    from training.config import load_config

    cfg = load_config(None, []).model
    with tempfile.TemporaryDirectory() as tmp:
        lengths, items = lengths_and_items(a.dataset, a.world_size, a.batch_size, Path(tmp))
    probes = {"calibrate probe (256 sampled)": cal.probe(cfg), "full softmax": full_softmax_probe(cfg, items)}
    timed = {
        k: calibrate(cal.lengths_up_to(MAX_LEN), batch=16, repeats=5, model="training", budget_s=60, step=step)
        for k, step in probes.items()
    }
    runs = timed["full softmax"](lengths)  # the cost that runs
    sizes = {"world_size": a.world_size, "batch_size": a.batch_size, "seed": 0}
    plans = {f"balanced by {k}": balance.plan(m(lengths), **sizes) for k, m in timed.items()}
    plans["random shards"] = balance.random_plan(runs, **sizes)
    rows = []
    print(f"{a.dataset}: {len(lengths):,} samples, {items:,} items, world {a.world_size} x batch {a.batch_size}")
    for k, m in timed.items():
        fitted = f"a={m.a:.4g} b={m.b:.4g} c0={m.c0:.4g} (r^2 {m.fit['r2']:.3f})"
        print(f"  c(L) {k}: {fitted}; c(50)/c(5) = {m(50) / m(5):.2f}")
    print("| shards | imbalance p50 | imbalance mean | bubble fraction |\n|---|---|---|---|")
    for k, plan in plans.items():
        st = balance.stats(plan, runs)
        rows.append({"plan": k, **st})
        print(f"| {k} | {st['imbalance']['p50']:.4f} | {st['imbalance']['mean']:.4f} | {st['bubble_fraction']:.4f} |")
    doc = {
        "dataset": a.dataset,
        "samples": len(lengths),
        "items": items,
        **sizes,
        "cost_models": {k: {"a": m.a, "b": m.b, "c0": m.c0, "r2": m.fit["r2"]} for k, m in timed.items()},
        "rows": rows,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
