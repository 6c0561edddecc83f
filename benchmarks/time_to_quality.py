"""Time to quality: how soon ftrec's training reaches a quality target, on this machine.

    python benchmarks/time_to_quality.py [--datasets beauty,video] [--groups 1,2]
        [--config FILE] [--set section.key=value ...] [--minutes 15] [--json PATH]
    python benchmarks/time_to_quality.py --reference DIR [--reference-log FILE] [--json PATH]

The first (the default) is against the public state of the art (issue #39): full ranking with
history excluded, the public figures as reference lines, and the wall time at which test
NDCG@10 first reaches 0.95x and 1.0x of the SASRec + sampled softmax figure, per dataset and
replica-group count (benchmarks/public_quality.py says how).

The second is against the reference SASRec in PyTorch (pmixer/SASRec.pytorch), on video.txt,
one right after the other on this machine, both at maxlen 50.
DIR is a checkout of the reference's `python/` folder (main.py, model.py, utils.py),
obtained by you from its public repository; ftrec ships none of its code. The script:

1. trains ftrec (step 2), then runs the reference for 20 epochs (`main.py --dataset=Video --maxlen=50 --device=cpu
   --num_epochs=20`, its defaults otherwise) and reads, from its epoch-20 line, its training
   time (its own clock, which leaves out its evaluations) and its test HR@10 under its own
   protocol (100 sampled negatives the user never rated, 10,000 random users): the target;
   `--reference-log` reads a finished run's log instead of running it again;
2. builds ftrec's shards of the same file (batch 128, max_len 50) and trains ftrec's default
   SASRec for up to 20 epochs with a checkpoint every half epoch and no evaluation in the
   loop, timing from the trainer's "steps/epoch" line (after its data loading, as the
   reference's clock starts after its own) to each checkpoint;
3. evaluates checkpoints (test split, sampled protocol: 100 uniform negatives the user never
   interacted with; every user) by bisection for the first that reaches the target.

Reported: each side's wall seconds to the target and CPU seconds (user+sys of the process
and its children: less sensitive to a shared machine's load), and the ratios.
"""

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from training.checkpoint_key import use_default

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import public_quality  # noqa: E402
from benchmarks.public_quality import first_reaching  # noqa: E402

VIDEO = ROOT.parent / "shared" / "data" / "video.txt"
EPOCH_LINE = re.compile(
    r"epoch:(\d+), time: ([\d.]+)\(s\), valid \(NDCG@10: ([\d.]+), HR@10: ([\d.]+)\), "
    r"test \(NDCG@10: ([\d.]+), HR@10: ([\d.]+)\)"
)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def reference(ref: Path, log: Path | None) -> dict:
    wall: float | None = None  # the process's own figures: only when this run trains the reference
    cpu: float | None = None
    if log is None:
        data = ref / "data"
        data.mkdir(exist_ok=True)
        shutil.copy(VIDEO, data / "Video.txt")
        log = ref / "ttq-run.log"
        cpu0, t0 = _cpu(), time.monotonic()
        with open(log, "w") as f:
            subprocess.run(
                [
                    sys.executable,
                    "main.py",
                    "--dataset=Video",
                    "--train_dir=ttq",
                    "--maxlen=50",
                    "--device=cpu",
                    "--num_epochs=20",
                ],
                cwd=ref,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=4 * 3600,
                check=True,
                env={**os.environ, "OMP_NUM_THREADS": "2"},
            )
        wall, cpu = time.monotonic() - t0, _cpu() - cpu0
    m = [x for x in (EPOCH_LINE.search(line) for line in log.read_text().splitlines()) if x and int(x.group(1)) == 20]
    if not m:
        sys.exit(f"error: {log} has no epoch-20 evaluation line")
    g = m[-1].groups()
    return {
        "train_s": float(g[1]),
        "test_hr10": float(g[5]),
        "test_ndcg10": float(g[4]),
        "process_wall_s": wall,
        "process_cpu_s": cpu,
        "log": str(log),
    }


def ftrec_train(work: Path) -> dict:
    """Train first (every checkpoint kept); `ftrec_reach` evaluates once the target is known."""
    shards, out = work / "shards", work / "train"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dataprep",
            "shards",
            "--input",
            str(VIDEO),
            "--format",
            "sasrec",
            "--out",
            str(shards),
            "--world-size",
            "1",
            "--batch-size",
            "128",
            "--max-len",
            "50",
        ],
        cwd=ROOT,
        check=True,
        timeout=600,
        stdout=subprocess.DEVNULL,
    )
    steps = json.loads((shards / "manifest.json").read_text())["steps"]
    every = max(steps // 2, 1)
    cpu0 = _cpu()
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "training",
            "train",
            "--shards",
            str(shards),
            "--out",
            str(out),
            "--set",
            "train.epochs=20",
            "eval.periodic=false",
            "eval.final=false",
            f"train.checkpoint_every={every}",
            "train.keep_checkpoints=1000",
            "mlflow.enabled=false",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    t0 = None
    assert p.stdout is not None  # stdout=PIPE
    for line in p.stdout:
        if t0 is None and "steps/epoch" in line:
            t0 = time.time()
    if p.wait(timeout=4 * 3600) != 0 or t0 is None:
        sys.exit("error: ftrec training failed")
    ckpts = sorted((out / "checkpoints").glob("step-*"))
    return {
        "shards": shards,
        "steps": steps,
        "cpu": _cpu() - cpu0,
        "ckpts": ckpts,
        "times": {c: c.stat().st_mtime - t0 for c in ckpts},
    }


def ftrec_reach(work: Path, run: dict, target: float) -> dict:
    shards, steps, cpu, ckpts, times = run["shards"], run["steps"], run["cpu"], run["ckpts"], run["times"]

    def hr(c: Path) -> float:
        j = work / f"eval-{c.name}.json"
        if not j.exists():
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "training",
                    "eval",
                    "--checkpoint",
                    str(c),
                    "--shards",
                    str(shards),
                    "--out",
                    str(j),
                ],
                cwd=ROOT,
                check=True,
                timeout=1800,
                stdout=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        m = json.loads(j.read_text())
        return float(m.get("metrics", m)["test/sampled/hr@10"])

    c = first_reaching(ckpts, hr, target, None)  # by bisection over every checkpoint
    if c is None:
        return {"reached": False, "best_hr10_last": hr(ckpts[-1]), "train_s": times[ckpts[-1]], "cpu_s": cpu}
    return {
        "reached": True,
        "checkpoint": c.name,
        "epoch": round(int(c.name.split("-")[1]) / steps, 2),
        "test_hr10": hr(c),
        "train_s": round(times[c], 1),
        "train_s_20_epochs": round(times[ckpts[-1]], 1),
        "cpu_s_20_epochs": round(cpu, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", type=Path, help="the reference's python/ folder: compare with it instead")
    p.add_argument("--reference-log", type=Path, help="a finished reference run's log (skip running it)")
    public_quality.add_arguments(p)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--json", help="where the results go (default: bench-results/, by comparison)")
    a = p.parse_args()
    if a.reference is None:
        return public_quality.run(a)
    if not VIDEO.is_file():
        sys.exit(f"error: {VIDEO} not found")
    work = a.work or Path(tempfile.mkdtemp(prefix="ftrec-ttq-"))
    use_default(work)  # the checkpoint key its `training` runs seal and verify with, unless one is set
    run = ftrec_train(work)  # ftrec first, then the reference: one right after the other
    ref = reference(a.reference, a.reference_log)
    ours = ftrec_reach(work, run, ref["test_hr10"])
    print("| | 20-epoch test HR@10 (target) | time to target (s) | CPU s |\n|---|---|---|---|")
    print(
        f"| reference | {ref['test_hr10']:.4f} | {ref['train_s']:.0f} (its clock, 20 epochs) | "
        f"{ref['process_cpu_s'] or float('nan'):.0f} (whole run) |"
    )
    if ours["reached"]:
        print(
            f"| ftrec | {ours['test_hr10']:.4f} at epoch {ours['epoch']} | {ours['train_s']:.0f} | "
            f"{ours['cpu_s_20_epochs']:.0f} (20 epochs) |"
        )
        print(f"\nftrec reaches the reference's 20-epoch test HR@10 {ref['train_s'] / ours['train_s']:.1f}x sooner")
    else:
        print(f"| ftrec | not reached in 20 epochs (last {ours['best_hr10_last']:.4f}) | | |")
    out = Path(a.json or ROOT / "bench-results" / "time_to_quality.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"reference": ref, "ftrec": ours}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
