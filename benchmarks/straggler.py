"""The cross-group straggler wait on the main path, balanced against random shards: 2 replica
groups of the real trainer under the launcher, on the shared Beauty data.

    python benchmarks/straggler.py [--steps 150] [--reps 2] [--json PATH]

Shards for 2 ranks (one per group), batch 128, max_len 50: `balanced` is dataprep's default
(steps of equal cost across ranks, the calibrated cost model of the model trained),
`random` is window K=1 (batches in random order: the ranks of a step get unequal work).
Each run logs to its own MLflow store; reported from group 0's run: ft/straggler_s (group
0's wait in the FTAR for the slowest group, per step), ft/transfer_s (the exchange itself),
ft/bubble_fraction (the groups' time not spent computing) and train/tokens_per_s, means over
the logged points after the first; modes interleaved.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEAUTY = ROOT.parent / "shared" / "data" / "beauty.txt"
KEYS = ("ft/straggler_s", "ft/transfer_s", "ft/bubble_fraction", "train/tokens_per_s")


def shards(work: Path, mode: str) -> Path:
    from dataprep.build import build_shards
    from dataprep.settings import ShardSettings
    from training import calibrate
    from training.config import ModelConfig

    out = work / f"shards-{mode}"
    cm = calibrate.cached(ModelConfig(), 50, work / "cost-models")
    settings = ShardSettings(
        world_size=2, batch_size=128, max_len=50, cost_model=cm, window_steps=1 if mode == "random" else None
    )
    build_shards(str(BEAUTY), "iclrec", str(out), settings)
    return out


def run(work: Path, mode: str, rep: int, steps: int) -> dict:
    from mlflow import MlflowClient

    out = work / f"run-{mode}-{rep}"
    uri = f"sqlite:///{work / f'mlflow-{mode}-{rep}.db'}"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "training",
            "launch",
            "--shards",
            str(work / f"shards-{mode}"),
            "--replica-groups",
            "2",
            "--out",
            str(out),
            "--timeout",
            "900",
            "--",
            "--set",
            f"train.max_steps={steps}",
            "train.log_every=10",
            "eval.periodic=false",
            "eval.final=false",
            f"mlflow.tracking_uri={uri}",
            "mlflow.log_model=false",
            "mlflow.plots=false",
            "mlflow.system_metrics=false",
            "mlflow.register=false",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1200,
    )
    if r.returncode != 0:
        raise RuntimeError(f"{mode}: launcher failed ({r.returncode}):\n{r.stdout[-3000:]}")
    c = MlflowClient(uri)
    run_id = json.loads((out / "replica_0" / "result.json").read_text())["mlflow_run_id"]
    row = {"mode": mode, "rep": rep}
    for k in KEYS:
        vals = [m.value for m in sorted(c.get_metric_history(run_id, k), key=lambda m: m.step)][1:]
        row[k] = round(statistics.mean(vals), 5) if vals else None
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", default=str(ROOT / "bench-results" / "straggler.json"))
    a = p.parse_args()
    if not BEAUTY.is_file():
        sys.exit(f"error: {BEAUTY} not found")
    work = Path(tempfile.mkdtemp(prefix="ftrec-straggler-"))
    for mode in ("balanced", "random"):
        shards(work, mode)
    rows = [run(work, m, i, a.steps) for i in range(a.reps) for m in ("balanced", "random")]
    print("| mode | run | " + " | ".join(KEYS) + " |\n|---|---|" + "---|" * len(KEYS))
    for r in rows:
        print(f"| {r['mode']} | {r['rep']} | " + " | ".join(str(r[k]) for k in KEYS) + " |")
    med = {
        m: {k: statistics.median(r[k] for r in rows if r["mode"] == m and r[k] is not None) for k in KEYS}
        for m in ("balanced", "random")
    }
    print(
        f"\nstraggler s per step, balanced / random: "
        f"{med['balanced']['ft/straggler_s'] / med['random']['ft/straggler_s']:.2f}; tokens/s balanced / random: "
        f"{med['balanced']['train/tokens_per_s'] / med['random']['train/tokens_per_s']:.2f}"
    )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"rows": rows, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
