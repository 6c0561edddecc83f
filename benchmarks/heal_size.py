"""What a heal costs the survivors, by the size of the state healed (issue #20, item 3).

    python benchmarks/heal_size.py [--dims 64,1024,2048,4096] [--steps 200] [--json PATH]

ftcore's toy trainer (a dim x dim MLP under AdamW: the state is about 12 x dim^2 bytes) as 3
replica groups of one rank under the launcher with warm spares; group 1 is killed at step 30,
its spare heals from a survivor. Per dim: the state's size, the heal's own figures from the
timeline (the source's snapshot to the healer's download, `heal_fetched`), and each survivor's
longest wait between commits across the episode beyond one step (benchmarks/stall.py's
episodes), the heal source's marked. The healing group and its source stand aside from the
heal step's exchange, and the next round waits for both: the download overlaps the others'
heal step, and what it takes beyond that step they wait.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.launcher import launch, toy  # noqa: E402
from benchmarks.stall import episodes  # noqa: E402
from ftcore.util.files import atomic_write_json  # noqa: E402

FAULTS = [{"kind": "kill", "group": 1, "at_step": 30}]


def state_mb(dim: int) -> float:
    """The toy's parameters and AdamW's two moments, float32."""
    return 3 * (dim * dim + 2 * dim + 1) * 4 / 2**20


def measure(dim: int, steps: int, folder: str) -> dict:
    tl = launch(os.path.join(folder, f"dim{dim}"), FAULTS, toy(steps, 0.04, dim), options=["--max-restarts", "4"])
    heals = [e for e in tl["lighthouse_events"] if e["kind"] == "heal_fetched"]
    sources = {e["source"] for e in tl["lighthouse_events"] if e["kind"] == "heal_assigned"}
    rows = episodes(tl, 3, [FAULTS])
    return {
        "dim": dim,
        "state_mb": state_mb(dim),
        "step_s": rows[0]["step_s"] if rows else None,
        "heal_fetch_s": [round(e["seconds"], 3) for e in heals],
        # each survivor's, the heal source's marked: it copies its state and serves it
        "survivors": [
            {
                "group": r["survivor"],
                "source": r["survivor"] in sources,
                "longest_gap_beyond_step_s": round(r["longest_gap_beyond_step_s"], 3),
                "extra_stall_s": round(r["extra_stall_s"], 3),
            }
            for r in rows
        ],
        "same_state": len(set(tl["checksums"].values())) == 1,
    }


def main() -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/heal_size.py", description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="64,1024,2048,4096", help="toy model widths, comma-separated")
    ap.add_argument("--steps", type=int, default=200, help="steps per run (the kill is at step 30)")
    ap.add_argument("--json", default=str(ROOT / "bench-results" / "heal_size.json"))
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="heal_size-") as folder:
        for dim in (int(x) for x in a.dims.split(",")):
            rows.append(measure(dim, a.steps, folder))
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"{'dim':>5} {'state MB':>9} {'step s':>7} {'heal fetch s':>13}  survivors: longest gap beyond a step, s")
    for r in rows:
        fetch = ", ".join(f"{x:.3f}" for x in r["heal_fetch_s"])
        step = f"{r['step_s']:.3f}" if r["step_s"] is not None else "-"
        gaps = ", ".join(
            f"g{x['group']}{' (source)' if x['source'] else ''} {x['longest_gap_beyond_step_s']:.3f}"
            for x in r["survivors"]
        )
        print(f"{r['dim']:>5} {r['state_mb']:>9.1f} {step:>7} {fetch:>13}  {gaps}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(a.json, {"faults": FAULTS, "rows": rows}, indent=2)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
