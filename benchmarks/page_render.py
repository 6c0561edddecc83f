"""What the Airflow Lighthouse tab costs the API server for a large timeline.json (issue 41,
item 5).

    python benchmarks/page_render.py [--sizes 3:200,60:2000] [--json PATH]

Per size (MB of file : groups): a planted timeline of that size, each group committing one
step and the rest of the file events spread over the groups, read, summarized and rendered
as the tab does (lighthouse_app.lookup + render, no HTTP): the file's MB, groups, events,
the CPU seconds of one view and the page's KB. A file over the page's bound
(lighthouse_app.TIMELINE_MAX_BYTES) is refused, and its row says so.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]

EVENT_BYTES = 58  # about what one planted event takes in the file
KINDS = ["fault", "group_failed", "heal_finished", "checkpoint"]


def plant(path: Path, mb: float, groups: int) -> int:
    """Write a timeline of about `mb` MB over `groups` groups to `path`; its event count."""
    events = max(int(mb * 1e6 / EVENT_BYTES), 1)
    with open(path, "w") as f:
        f.write('{"exit_code":0,"steps":[')
        f.write(
            ",".join(f'{{"t":{1 + g * 1e-4},"group":{g},"rank":0,"step":1,"committed":true}}' for g in range(groups))
        )
        f.write('],"launcher_events":[')
        for i in range(events):
            sep = "," if i else ""
            f.write(f'{sep}{{"t":{2 + i * 1e-5:.5f},"kind":"{KINDS[i % 4]}","group":{i % groups},"note":"x"}}')
        f.write('],"lighthouse_events":[]}')
    return events


def view(dag_id: str, run_id: str) -> tuple[float, int, str]:
    """(CPU seconds, page bytes, note) of one view of the run's tab."""
    from ftrec_airflow import lighthouse_app

    t = time.process_time()
    doc = lighthouse_app.lookup(dag_id, run_id)
    page = lighthouse_app.render(doc)
    return time.process_time() - t, len(page.encode()), "refused" if doc["timeline"] is None else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="3:200,60:2000", help="MB:groups, comma separated")
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        os.environ["FTREC_WORK"] = work
        os.environ.pop("FTREC_LIGHTHOUSE_URL", None)
        from ftrec_airflow import settings

        for i, spec in enumerate(a.sizes.split(",")):
            mb, groups = float(spec.split(":")[0]), int(spec.split(":")[1])
            run = settings.run_folder("bench", f"r{i}")
            (run / "train").mkdir(parents=True)
            path = run / "train" / "timeline.json"
            events = plant(path, mb, groups)
            secs, out, note = view("bench", f"r{i}")
            rows.append(
                {
                    "file_mb": round(path.stat().st_size / 1e6, 1),
                    "groups": groups,
                    "events": events,
                    "render_s": round(secs, 2),
                    "output_kb": round(out / 1024, 1),
                    "note": note,
                }
            )
    print(f"{'file MB':>8} {'groups':>7} {'events':>9} {'render s':>9} {'output KB':>10}")
    for r in rows:
        print(
            f"{r['file_mb']:>8} {r['groups']:>7} {r['events']:>9} {r['render_s']:>9} {r['output_kb']:>10} {r['note']}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
