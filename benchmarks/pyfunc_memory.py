"""What one predict of the served model costs in memory, chunked vs all at once (issue #41, item 8).

    nice -n 19 python benchmarks/pyfunc_memory.py [--rows 2000] [--big 1000000] [--small 100000] [--json PATH]

A random SeqRec (dim 64, max_len 50) over `big` and `small` items goes through
training/serving.write; each case loads it in a fresh subprocess as the pyfunc does, warms
it up, then predicts k=10 for `rows` histories of 20 known ids. Peak = the process's
VmHWM (reset through /proc/self/clear_refs after the warm-up) minus its VmRSS before the
predict. "all at once" is the pyfunc with one chunk of every row and every item (the old
path's [rows, items] float32 scores); it runs at `small` items only: at `big` items its
scores alone are rows x big x 4 bytes, printed as its bound.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftcore.util.files import atomic_write_json  # noqa: E402

HIST_LEN, K = 20, 10


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return kb / 1024


def measure(folder: str, rows: int, row_chunk: int, item_chunk: int) -> dict:
    """In this (fresh) process: load the pyfunc from `folder`, predict once, the peak growth."""
    import pandas as pd
    import torch

    from training import ftrec_recommender_pyfunc as pyfunc

    torch.manual_seed(0)
    exported = json.loads(Path(folder, "exported.json").read_text())
    rec = pyfunc.FtrecRecommender()
    rec.load_context(SimpleNamespace(artifacts=exported["artifacts"], model_config=exported["model_config"]))
    rec.row_chunk, rec.item_chunk, rec.max_rows = row_chunk, item_chunk, max(rows, pyfunc.MAX_ROWS)
    ids = torch.randint(0, len(rec.raw_ids), (rows, HIST_LEN)).tolist()
    frame = pd.DataFrame({"history": [[rec.raw_ids[j] for j in row] for row in ids]})
    rec.predict(None, frame.head(2), {"k": K})  # warm-up: lazy allocations, thread pools
    before = _status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    t = time.perf_counter()
    out = rec.predict(None, frame, {"k": K})
    seconds = time.perf_counter() - t
    assert all(len(i) == K for i in out["items"])
    request_kb = len(frame.to_json(orient="split")) / 1024
    return {
        "peak_mb": _status_mb("VmHWM") - before,
        "seconds": seconds,
        "rss_before_mb": before,
        "request_kb": request_kb,
    }


def _export(n_items: int, folder: str) -> None:
    import torch

    from training.config import ModelConfig
    from training.model import SeqRec
    from training.serving import write

    torch.manual_seed(0)
    model = SeqRec(n_items, ModelConfig(dim=64, num_heads=2, max_len=50)).eval()
    exported = write(model, [f"item{i}" for i in range(n_items)], folder)
    Path(folder, "exported.json").write_text(json.dumps(exported))


def _case(folder: str, rows: int, row_chunk: int, item_chunk: int) -> dict:
    args = [folder, str(rows), str(row_chunk), str(item_chunk)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    p = subprocess.run([sys.executable, __file__, "--measure", *args], capture_output=True, text=True, env=env)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/pyfunc_memory.py", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--big", type=int, default=1_000_000)
    ap.add_argument("--small", type=int, default=100_000)
    ap.add_argument("--json", default=str(ROOT / "bench-results" / "pyfunc_memory.json"))
    ap.add_argument("--measure", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure[0], *map(int, a.measure[1:]))))
        return 0
    from training import ftrec_recommender_pyfunc as pyfunc

    chunked = (pyfunc.ROW_CHUNK, pyfunc.ITEM_CHUNK)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n_items in (a.big, a.small):
            folder = os.path.join(tmp, str(n_items))
            _export(n_items, folder)
            cases = [("chunked", *chunked)] + ([("all at once", a.rows, n_items)] if n_items == a.small else [])
            for name, row_chunk, item_chunk in cases:
                got = _case(folder, a.rows, row_chunk, item_chunk)
                bound_mb = min(row_chunk, a.rows) * min(item_chunk, n_items) * 4 / 2**20
                results.append(
                    {
                        "path": name,
                        "items": n_items,
                        "rows": a.rows,
                        "row_chunk": row_chunk,
                        "item_chunk": item_chunk,
                        "scores_bound_mb": bound_mb,
                        **got,
                    }
                )
    print(f"{'path':<12} {'items':>9} {'rows':>5} {'chunk':>14} {'bound MB':>9} {'peak MB':>8} {'seconds':>8}")
    for r in results:
        chunk = f"{r['row_chunk']}x{r['item_chunk']}"
        print(
            f"{r['path']:<12} {r['items']:>9,} {r['rows']:>5} {chunk:>14} {r['scores_bound_mb']:>9.0f} "
            f"{r['peak_mb']:>8.0f} {r['seconds']:>8.2f}"
        )
    print(f"all at once at {a.big:,} items (not run): scores alone {a.rows * a.big * 4 / 2**20:,.0f} MB")
    print(f"request: {results[0]['request_kb']:.0f} KB of {a.rows} histories of {HIST_LEN} ids, k={K}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(a.json, {"hist_len": HIST_LEN, "k": K, "rows": results}, indent=2)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
