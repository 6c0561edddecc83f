"""Time to quality against the public state of the art (issue #39): full ranking, history
excluded, leave-one-out, on the shared Amazon files. Run through `benchmarks/time_to_quality.py`
(its default comparison):

    python benchmarks/time_to_quality.py [--datasets beauty,video] [--groups 1,2]
        [--config FILE] [--set section.key=value ...] [--minutes 15] [--json PATH]

Per dataset and replica-group count: shards (batch 128 per rank, max_len 50), then ftrec
trains with its defaults (or `--config`, then `--set`) for at most `--minutes` of training,
a checkpoint every half epoch, validation as the config says; one group runs `training
train`, more run `training launch` (group 0's checkpoints are the job's: every group holds the
same state). Then the checkpoints' test metrics (full ranking, every user) find the wall time
at which test NDCG@10 first reached 0.95x and 1.0x of the public SASRec + sampled softmax
figure (bisection: the curve is taken to rise until it peaks), and the run's own model (the
best validation's, or the last) is scored against the public rows. Times count from the
trainer's "steps/epoch" line (after its data loading) to each checkpoint's write.

The public rows: on Beauty, the eSASRec paper (arXiv 2508.06450) and its benchmark, on the
same file (../shared/data/README.md). Video has no published figure for this protocol; its
target is that benchmark's SASRec + sampled softmax recipe (configs/public-sasrec-sampled-softmax.toml)
trained in ftrec to its own early stop on this machine (BENCHMARKS.md).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from training.checkpoint_key import use_default  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
FILES = {"beauty": ("beauty.txt", "iclrec"), "video": ("video.txt", "sasrec")}
# test full HR@10, NDCG@10, history excluded: Beauty's published (../shared/data/README.md)
PUBLIC = {
    "beauty": {
        "SASRec + sampled softmax, 256 negatives (public)": (0.0921, 0.0531),
        "eSASRec, LiGR + sampled softmax (public)": (0.0928, 0.0523),
        "HSTU, recomputed (public)": (0.0788, 0.0439),
        "SASRec, BCE (public)": (0.0605, 0.0318),
    },
    "video": {
        # reproduced, not published: the recipe's settings (configs/public-sasrec-sampled-softmax.toml)
        # trained in ftrec to their early stop (BENCHMARKS.md)
        "SASRec + sampled softmax, 256 negatives: the public recipe, reproduced in ftrec": (0.0907, 0.0488),
    },
}
# the figure time to quality is measured against: each dataset's SASRec + sampled softmax row
TARGET = {name: next(k for k in rows if k.startswith("SASRec + sampled softmax")) for name, rows in PUBLIC.items()}


def _run(argv: list[str], timeout: float, out=subprocess.DEVNULL) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, *argv], cwd=ROOT, check=True, timeout=timeout, stdout=out, env=env)


def shards(name: str, groups: int, work: Path) -> Path:
    fname, fmt = FILES[name]
    out = work / f"{name}-w{groups}"
    if not (out / "manifest.json").exists():
        _run(
            ["-m", "dataprep", "shards", "--input", str(DATA / fname), "--format", fmt, "--out", str(out)]
            + ["--world-size", str(groups), "--batch-size", "128", "--max-len", "50", "--quiet"],
            900,
        )
    return out


def train(data: Path, groups: int, out: Path, config: list[str], settings: list[str], minutes: float) -> dict:
    """Trains with a checkpoint every half epoch (all kept); the checkpoints' wall seconds."""
    steps = json.loads((data / "manifest.json").read_text())["steps"]
    sets = [*settings, f"train.checkpoint_every={max(steps // 2, 1)}", "train.keep_checkpoints=100000"]
    sets += [f"train.max_minutes={minutes}", "mlflow.enabled=false"]
    if groups == 1:
        argv = ["-m", "training", "train", "--shards", str(data), "--out", str(out), *config, "--set", *sets]
        ckpt_dir = out / "checkpoints"
    else:
        argv = ["-m", "training", "launch", "--shards", str(data), "--out", str(out)]
        argv += ["--replica-groups", str(groups), "--ranks-per-group", "1", "--", *config, "--set", *sets]
        ckpt_dir = out / "replica_0" / "checkpoints"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log_path = out.parent / f"{out.name}.log"
    t0, started = None, time.time()
    with open(log_path, "w") as log:
        p = subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        assert p.stdout is not None
        for line in p.stdout:
            log.write(line)
            if t0 is None and "steps/epoch" in line:
                t0 = time.time()
        code = p.wait(timeout=6 * 3600)
    if code != 0 or t0 is None:
        sys.exit(f"error: training failed; its log: {log_path}")
    ckpts = sorted(c for c in ckpt_dir.glob("step-*") if (c / "meta.json").exists())
    result = json.loads(((out / "replica_0") if groups > 1 else out).joinpath("result.json").read_text())
    return {
        "steps_per_epoch": steps,
        "ckpts": ckpts,
        "seconds": {c: c.stat().st_mtime - t0 for c in ckpts},
        "wall_s": time.time() - started,
        "result": result,
    }


def test_metrics(ckpt: Path, data: Path, work: Path) -> dict:
    j = work / f"eval-{ckpt.parent.parent.name}-{ckpt.name}.json"
    if not j.exists():
        _run(["-m", "training", "eval", "--checkpoint", str(ckpt), "--shards", str(data), "--out", str(j)], 1800)
    m = json.loads(j.read_text())
    return m.get("metrics", m)


def first_reaching(ckpts: list[Path], value, target: float, best_step: int | None) -> Path | None:
    """The first checkpoint whose value reaches `target`, by bisection up to the curve's best
    (the best validation's checkpoint where the run selected one, else the last)."""
    upto = [c for c in ckpts if best_step is None or int(c.name.split("-")[1]) <= best_step]
    if not upto:
        return None
    lo, hi = 0, len(upto) - 1
    if value(upto[hi]) < target:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if value(upto[mid]) >= target:
            hi = mid
        else:
            lo = mid + 1
    return upto[lo]


def measure(name: str, groups: int, work: Path, config: list[str], settings: list[str], minutes: float) -> dict:
    data = shards(name, groups, work)
    run = train(data, groups, work / f"{name}-g{groups}", config, settings, minutes)
    final = run["result"].get("metrics", {})
    row = {
        "dataset": name,
        "groups": groups,
        "epochs": run["result"].get("epochs_completed"),
        "train_s": round(run["result"].get("train_seconds", float("nan")), 1),
        "wall_s": round(run["wall_s"], 1),
        "test_hr10": final.get("test/full/hr@10"),
        "test_ndcg10": final.get("test/full/ndcg@10"),
        "best": run["result"].get("best"),
        "early_stop": run["result"].get("early_stop"),
    }
    public = PUBLIC[name][TARGET[name]]
    ndcg = lambda c: float(test_metrics(c, data, work)["test/full/ndcg@10"])  # noqa: E731
    for share in (0.95, 1.0):
        best_step = (run["result"].get("best") or {}).get("step")
        c = first_reaching(run["ckpts"], ndcg, share * public[1], best_step)
        row[f"s_to_{share}x"] = None if c is None else round(run["seconds"][c], 1)
        row[f"epoch_at_{share}x"] = None if c is None else round(int(c.name.split("-")[1]) / run["steps_per_epoch"], 2)
    return row


def table(rows: list[dict]) -> str:
    head = "data | groups | model | test HR@10 | test NDCG@10 | vs SASRec + SS | to 0.95x NDCG | to 1.0x NDCG"
    out = [f"| {head} | epochs | training s |"]
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pub = PUBLIC[r["dataset"]][TARGET[r["dataset"]]]
        ratio = f"{r['test_hr10'] / pub[0]:.3f} / {r['test_ndcg10'] / pub[1]:.3f}"
        reach = [
            "not reached" if r.get(f"s_to_{s}x") is None else f"{r[f's_to_{s}x']:.0f} s (epoch {r[f'epoch_at_{s}x']})"
            for s in (0.95, 1.0)
        ]
        out.append(
            f"| {r['dataset']} | {r['groups']} | ftrec | {r['test_hr10']:.4f} | {r['test_ndcg10']:.4f} | {ratio} | "
            f"{reach[0]} | {reach[1]} | {r['epochs']:.1f} | {r['train_s']:.0f} |"
        )
    for name in dict.fromkeys(r["dataset"] for r in rows):
        for model, (hr, ndcg) in PUBLIC[name].items():
            out.append(f"| {name} | | {model} | {hr:.4f} | {ndcg:.4f} | | | | | |")
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--datasets", default="beauty,video", help="comma separated: beauty, video")
    p.add_argument("--groups", default="1,2", help="replica-group counts, comma separated")
    p.add_argument("--config", help="a trainer TOML (configs/...); default: the trainer's defaults")
    p.add_argument("--set", action="append", default=[], help="trainer setting section.key=value")
    p.add_argument("--minutes", type=float, default=15.0, help="training budget per run (train.max_minutes)")


def run(a: argparse.Namespace) -> int:
    """Every (dataset, groups) run against the public rows; the table, and JSON at `a.json`."""
    names = a.datasets.split(",")
    for name in names:
        if name not in FILES:
            sys.exit(f"error: --datasets: unknown {name!r} (choose from {', '.join(FILES)})")
        if not (DATA / FILES[name][0]).is_file():
            sys.exit(f"error: {DATA / FILES[name][0]} not found")
    work = a.work or Path(tempfile.mkdtemp(prefix="ftrec-pq-"))
    use_default(work)  # the checkpoint key the runs seal and verify with, unless one is set
    config = [] if a.config is None else ["--config", str(Path(a.config).resolve())]
    rows = []
    for name in names:
        for g in (int(x) for x in a.groups.split(",")):
            rows.append(measure(name, g, work, config, a.set, a.minutes))
            print(table(rows[-1:]), flush=True)
    print(table(rows))
    out = Path(a.json or ROOT / "bench-results" / "public_quality.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"rows": rows, "public": PUBLIC, "config": a.config, "settings": a.set}, indent=1, default=str)
    )
    return 0
