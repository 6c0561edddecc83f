"""`python benchmarks/comm_trainer_bench.py`: the real trainer's sharded item table, side by side.

`python -m training train` under torchrun (2 gloo ranks on CPU, one replica group) on one
shard set, in four configurations, each run `--rounds` times in alternating order so the
noise of a shared machine falls on all of them alike:

  replicated   nn.Embedding on every rank; its full-table gradient joins the dense all-reduce
  blocking     comm.embedding=sharded, every lookup inline where the model needs it
  overlapped   sharded, lookups submitted before the forward pass and the next batch's id
               exchange during the step, issued FIFO (the next batch's ids first)
  prioritized  the same, issued in need order: histories, targets, negatives, next ids

Per configuration (median over rounds): step time, the time rank 0 waited for the group's
communication per step (counts, lookups, embedding grads, the dense all-reduce), the part
of it that was lookups, the embedding-grad wait, tokens/s, and ratios against blocking.
Prints a table and writes bench-results/comm-trainer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ftcore.util.files import atomic_write_json
from ftcore.util.procs import free_port
from training.checkpoint_key import use_default

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "replicated": [],
    "blocking": ["comm.embedding=sharded", "comm.policy=blocking"],
    "overlapped": ["comm.embedding=sharded", "comm.policy=overlapped"],
    "prioritized": ["comm.embedding=sharded", "comm.policy=prioritized"],
}


def _run(argv: list[str], timeout: float) -> str:
    """A bounded child in its own process group, ended by that group on timeout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        argv, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise SystemExit(f"bench: {' '.join(argv[:4])} ... did not finish in {timeout:.0f}s") from None
    if p.returncode != 0:
        raise SystemExit(f"bench: {' '.join(argv[:4])} ... failed:\n{out[-3000:]}")
    return out


def make_shards(work: str, items: int, users: int) -> str:
    events, shards = os.path.join(work, "events.txt"), os.path.join(work, "shards")
    _run(
        [
            sys.executable,
            "-m",
            "dataprep",
            "synth",
            "--out",
            events,
            "--users",
            str(users),
            "--items",
            str(items),
            "--median-len",
            "30",
            "--max-history",
            "200",
            "--quiet",
        ],
        300,
    )
    _run(
        [
            sys.executable,
            "-m",
            "dataprep",
            "shards",
            "--input",
            events,
            "--format",
            "sasrec",
            "--out",
            shards,
            "--world-size",
            "2",
            "--batch-size",
            "32",
            "--max-len",
            "200",
            "--quiet",
        ],
        600,
    )
    return shards


def train_once(shards: str, out: str, settings: list[str], timeout: float) -> dict:
    use_default(ROOT / "bench-results")  # the ranks' checkpoint key (FTREC_CHECKPOINT_KEY_FILE), unless one is set
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    _run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "training",
            "train",
            "--shards",
            shards,
            "--out",
            out,
            "--set",
            *settings,
        ],
        timeout,
    )
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=100_000, help="catalogue size (the table: items x model.dim)")
    ap.add_argument("--users", type=int, default=4000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--negatives", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "comm-trainer.json"))
    a = ap.parse_args(argv)
    common = [
        f"train.max_steps={a.steps}",
        f"train.log_every={a.steps}",
        f"model.dim={a.dim}",
        "loss.kind=sampled_softmax",
        f"loss.num_negatives={a.negatives}",
        "mlflow.enabled=false",
        "eval.periodic=false",
        "eval.final=false",
        "train.checkpoint_every=0",
        "optim.warmup_steps=2",
    ]
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="ftrec-bench-") as work:
        shards = make_shards(work, a.items, a.users)
        for r in range(a.rounds):
            names = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
            for name in names:
                t = time.perf_counter()
                res = train_once(shards, os.path.join(work, f"{name}-{r}"), [*common, *CONFIGS[name]], 900)
                print(f"  round {r} {name:12s} {time.perf_counter() - t:6.1f}s", flush=True)
                runs[name].append(res)

    def med(name, f):
        return statistics.median(f(res) for res in runs[name])

    rows: dict[str, dict[str, float]] = {}
    for name in CONFIGS:
        steps = med(name, lambda r: r["throughput"]["steps"])
        rows[name] = {
            "step_ms": 1e3 * med(name, lambda r: r["throughput"]["step_seconds"] / r["throughput"]["steps"]),
            "wait_ms": 1e3 * med(name, lambda r: r["throughput"]["wait_s_per_step"]),
            "lookup_wait_ms": 1e3 * med(name, lambda r: r.get("comm", {}).get("lookup_wait_s", 0.0) / r["steps"]),
            "emb_grad_wait_ms": 1e3 * med(name, lambda r: r.get("comm", {}).get("emb_grad_wait_s", 0.0) / r["steps"]),
            "tokens_per_s": med(name, lambda r: r["throughput"]["tokens_per_s"]),
            "prefetch_hits": med(name, lambda r: r.get("comm", {}).get("prefetch_hits", 0)),
            "steps": steps,
        }
    base = rows["blocking"]
    head = [
        "config",
        "step ms",
        "comm wait ms",
        "lookup wait ms",
        "emb-grad wait ms",
        "tokens/s",
        "step / blocking",
        "lookup wait / blocking",
    ]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, row in rows.items():
        lw = (
            row["lookup_wait_ms"] / base["lookup_wait_ms"]
            if name != "replicated" and base["lookup_wait_ms"]
            else float("nan")
        )
        print(
            f"| {name} | {row['step_ms']:.1f} | {row['wait_ms']:.1f} | {row['lookup_wait_ms']:.1f} | "
            f"{row['emb_grad_wait_ms']:.1f} | {row['tokens_per_s']:.0f} | {row['step_ms'] / base['step_ms']:.2f} | "
            f"{lw:.2f} |"
        )
    atomic_write_json(a.out, {"args": vars(a), "rows": rows, "runs": runs}, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
