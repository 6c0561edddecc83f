"""What the Airflow Lighthouse tab costs the API server for a large timeline.json (issue 41).

    python benchmarks/page_render.py [--sizes 3:200,63.9:2000] [--json PATH]

Per size (MiB of file : groups): a planted timeline of that size, each group committing one
step and the rest of the file events spread over the groups, viewed as the tab does
(lighthouse_app.lookup + render, no HTTP) in four ways, side by side:
  parsed  - the timeline parsed and summarized on the request (the page before the writer's
            summary and the worker; today's path for a timeline up to INLINE_MAX_BYTES);
  writer  - with the launcher's timeline.summary.json beside it (training.timeline_summary.write);
  first   - no summary file: the first view, which queues the worker and returns;
  worker  - the view after the worker (a child process) summarized it.
Each: the view's CPU seconds in this process and its wall seconds, and the page's KB; the
writer's extra seconds for the summary file, and the worker's wall and child CPU seconds.
"""

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]

KINDS = ["fault", "group_failed", "heal_finished", "checkpoint"]


def _event(i: int, groups: int) -> str:
    # json.dumps's own spacing and float repr: the writer re-dumps these bytes unchanged
    return f'{{"t": {2 + i * 1e-5!r}, "kind": "{KINDS[i % 4]}", "group": {i % groups}, "note": "x"}}'


def plant(path: Path, mib: float, groups: int) -> int:
    """Write a timeline of about `mib` MiB over `groups` groups to `path`; its event count."""
    events = 0
    with open(path, "w") as f:
        f.write('{"exit_code": 0, "steps": [')
        f.write(
            ", ".join(
                f'{{"t": {1 + g * 1e-4!r}, "group": {g}, "rank": 0, "step": 1, "committed": true}}'
                for g in range(groups)
            )
        )
        f.write('], "launcher_events": [')
        end = int(mib * (1 << 20)) - 64  # the events until the file is `mib` MiB
        while f.tell() < end:
            f.write((", " if events else "") + _event(events, groups))
            events += 1
        f.write('], "lighthouse_events": []}')
    return events


def view(run: tuple[str, str]) -> dict:
    """CPU and wall seconds of one view of the run's tab, its page KB and its note."""
    from ftrec_airflow import lighthouse_app

    t, w = time.process_time(), time.perf_counter()
    doc = lighthouse_app.lookup(*run)
    page = lighthouse_app.render(doc)
    return {
        "cpu_s": round(time.process_time() - t, 3),
        "wall_s": round(time.perf_counter() - w, 3),
        "page_kb": round(len(page.encode()) / 1024, 1),
        "shown": doc["timeline"] is not None,
        "note": doc["note"][:60],
    }


def measure(run: tuple[str, str], train: Path, mib: float, groups: int) -> dict:
    from ftrec_airflow import lighthouse_app, timeline_cache
    from training import timeline_summary

    path = train / "timeline.json"
    events = plant(path, mib, groups)
    row: dict = {"file_mib": round(path.stat().st_size / (1 << 20), 1), "groups": groups, "events": events}
    inline = lighthouse_app.INLINE_MAX_BYTES
    lighthouse_app.INLINE_MAX_BYTES = 1 << 40  # the page as it was: parse on every view
    row["parsed"] = view(run)
    lighthouse_app.INLINE_MAX_BYTES = inline
    raw = path.read_bytes()
    tl = json.loads(raw)
    t = time.perf_counter()
    timeline_summary.write(str(train), tl)
    row["writer_write_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    (train / "plain.json").write_bytes(json.dumps(tl).encode())  # what writing the timeline alone costs
    row["timeline_write_s"] = round(time.perf_counter() - t, 2)
    (train / "plain.json").unlink()
    assert path.read_bytes() == raw, "the writer changed the planted bytes"
    del tl, raw
    row["writer"] = view(run)
    (train / timeline_summary.FILE).unlink()
    lighthouse_app.SUMMARIES = timeline_cache.Summaries(
        lambda fd: timeline_cache.in_child(fd, lighthouse_app.TIMELINE_MAX_BYTES)
    )
    kids, t = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    row["first"] = view(run)
    key = timeline_cache.key(path, os.stat(path))
    while lighthouse_app.SUMMARIES.get(key) is None and time.perf_counter() - t < 300:
        time.sleep(0.02)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row["worker_wall_s"] = round(time.perf_counter() - t, 2)
    row["worker_child_cpu_s"] = round(after.ru_utime + after.ru_stime - kids.ru_utime - kids.ru_stime, 2)
    row["worker_child_max_rss_mib"] = round(after.ru_maxrss / 1024)
    row["worker"] = view(run)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="3:200,63.9:2000", help="MiB:groups, comma separated")
    ap.add_argument("--json", default="bench-results/page_render.json", help="write the rows here too")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        os.environ["FTREC_WORK"] = work
        os.environ.pop("FTREC_LIGHTHOUSE_URL", None)
        from ftrec_airflow import settings

        for i, spec in enumerate(a.sizes.split(",")):
            mib, groups = float(spec.split(":")[0]), int(spec.split(":")[1])
            train = settings.run_folder("bench", f"r{i}") / "train"
            train.mkdir(parents=True)
            rows.append(measure(("bench", f"r{i}"), train, mib, groups))
    print(f"{'file MiB':>8} {'groups':>6} {'events':>8}  {'view':<7} {'CPU s':>6} {'wall s':>6} {'page KB':>7}  note")
    for r in rows:
        for case in ("parsed", "writer", "first", "worker"):
            v = r[case]
            print(
                f"{r['file_mib']:>8} {r['groups']:>6} {r['events']:>8}  {case:<7} {v['cpu_s']:>6} {v['wall_s']:>6} "
                f"{v['page_kb']:>7}  {v['note'] or ('summary shown' if v['shown'] else '')}"
            )
        print(
            f"{'':>25}  parsed/writer CPU {r['parsed']['cpu_s'] / max(r['writer']['cpu_s'], 1e-3):.0f}x; "
            f"writer: {r['writer_write_s']} s (timeline alone {r['timeline_write_s']} s); worker: "
            f"{r['worker_wall_s']} s wall, child {r['worker_child_cpu_s']} CPU-s, {r['worker_child_max_rss_mib']} MiB"
        )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
