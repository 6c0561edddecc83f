"""What keyed checkpoints cost: save and load time and a load's peak memory, against plain torch.

    python benchmarks/checkpoint_cost.py [--items 1000000 --dim 64 --reps 3] [--impl FILE]

The state is a realistic `state.pt`: an item table of --items x --dim float32 with Adam's two
moments beside it (3 x items x dim x 4 bytes) and an RNG state. "plain" is torch.save and
torch.load(weights_only=True) with no integrity at all; "checkpoint" is training/checkpoint.py's
save and load (or the module in FILE, e.g. an earlier commit's: `git show REV:training/checkpoint.py
> /tmp/old.py`). Each load runs in a fresh process (its peak RSS, VmHWM, above the interpreter's
before the load); medians. Linux only.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOAD = """
import importlib.util, json, sys, time, torch
impl, how, path = sys.argv[1:4]
spec = importlib.util.spec_from_file_location("ckpt", impl); m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
def hwm():  # this process's peak RSS in KB (VmHWM: ru_maxrss would count the parent's, from before exec)
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:"))
base = hwm()
t = time.perf_counter()
state = torch.load(path + "/state.pt", map_location="cpu", weights_only=True) if how == "plain" else m.load(path)
dt = time.perf_counter() - t
print(json.dumps({"s": dt, "extra_mb": (hwm() - base) / 1024}))
"""


def _impl(path: str):
    spec = importlib.util.spec_from_file_location("ckpt", path)
    assert spec and spec.loader
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _state(items: int, dim: int) -> dict:
    import torch

    table = torch.randn(items + 1, dim)
    return {
        "model": {"item_emb.weight": table},
        "optimizer": {"exp_avg": torch.randn_like(table), "exp_avg_sq": torch.rand_like(table)},
        "rng": torch.get_rng_state(),
    }


def _run(impl: str, how: str, folder: str, state: dict, reps: int) -> dict:
    import torch

    m, saves, loads = _impl(impl), [], []
    for _ in range(reps):
        t = time.perf_counter()
        if how == "plain":
            os.makedirs(folder, exist_ok=True)
            torch.save(state, os.path.join(folder, "state.pt"))
        else:
            folder = m.save(os.path.dirname(folder), state, {"step": 1}, keep=1, distributed=False)
        saves.append(time.perf_counter() - t)
        out = subprocess.run([sys.executable, "-c", LOAD, impl, how, folder], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        loads.append(json.loads(out.stdout.splitlines()[-1]))
    return {
        "save_s": statistics.median(saves),
        "load_s": statistics.median(x["s"] for x in loads),
        "load_extra_mb": statistics.median(x["extra_mb"] for x in loads),
        "mb": os.path.getsize(os.path.join(folder, "state.pt")) / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--impl", default=str(ROOT / "training" / "checkpoint.py"), help="the checkpoint module to time")
    a = p.parse_args(argv)
    from training.checkpoint_key import use_default

    state = _state(a.items, a.dim)
    with tempfile.TemporaryDirectory(prefix="ftrec-ckpt-") as d:
        use_default(d)  # a key for this run alone, unless FTREC_CHECKPOINT_KEY_FILE is set
        rows = {
            how: _run(a.impl, how, os.path.join(d, how, "step-00000001"), state, a.reps)
            for how in ("plain", "checkpoint")
        }
    print(f"state.pt {rows['plain']['mb']:.0f} MB ({a.items} items x {a.dim}, Adam), {a.reps} reps, impl {a.impl}")
    print("| | save | load | load's peak RSS above the interpreter's |\n|---|---|---|---|")
    for how, r in rows.items():
        print(f"| {how} | {r['save_s']:.2f} s | {r['load_s']:.2f} s | {r['load_extra_mb']:.0f} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
