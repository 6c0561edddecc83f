"""ftcore benchmarks, side by side in one run: `python benchmarks/ftcore_bench.py [--quick]`.

1. all-reduce: FTAR (the full step protocol: quorum overlapped, FTAR, vote) against a
   plain gloo all-reduce of the same tensor in the same processes, and against
   torchft 0.2.0's managed all-reduce (its Manager + lighthouse), 1-256 MB, 2 and 3
   replica groups (one process each);
2. failover and heal: the launcher with the toy trainer, 3 groups, a kill -9 schedule:
   kill -> survivors' next commit, kill -> the returning group's first commit, and the
   survivors' extra stall per failure;
3. effective training time under the same kill schedule: FT-HSDP (restart the failed
   group alone, spare process, heal) against restarting every group from the last
   checkpoint with cold processes (what torchrun's elastic restart does).

Prints tables and writes bench-results/ftcore.json (with `failover_s`, `heal_s` and
`stall_per_failure_s` medians for the scale model).
"""

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from ftcore.util.files import atomic_write_json
from ftcore.util.procs import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.launcher import launch, toy  # noqa: E402

MB = 1 << 20


# ---- 1. all-reduce --------------------------------------------------------------------------
def _ar_worker(
    i: int, n: int, sizes: list[int], iters: dict, store_port: int, lh: str, tf_lh: str | None, q: mp.Queue
) -> None:
    """One replica group. The modes take turns inside every iteration, so that the load of
    this shared machine hits them alike; each timed op starts after a barrier."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from ftcore.manager import Manager, ManagerConfig

    store = dist.TCPStore(
        "127.0.0.1", store_port, is_master=(i == 0), wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    # Any: torch's stubs give ProcessGroupGloo (a Backend) no collectives; allreduce and barrier exist
    plain: Any = dist.ProcessGroupGloo(dist.PrefixStore("plain", store), i, n, datetime.timedelta(seconds=60))
    mgr = Manager(
        ManagerConfig(lighthouse=lh, group=i, num_groups=n, min_replicas=1),
        state_dict=lambda: {},
        load_state_dict=lambda s: None,
    )
    tfm = None
    if tf_lh:
        from torchft import Manager as TFManager
        from torchft.process_group import ProcessGroupGloo as TFGloo

        tf_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        tfm = TFManager(
            pg=TFGloo(),
            load_state_dict=lambda s: None,
            state_dict=lambda: {},
            min_replica_size=1,
            replica_id=f"r{i}",
            lighthouse_addr=tf_lh,
            store_addr="127.0.0.1",
            store_port=tf_store.port,
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )

    def ftar_step(t):
        mgr.allreduce([t])
        assert mgr.should_commit(), mgr.errors

    def tf_step(t):
        tfm.allreduce(t).wait()
        assert tfm.should_commit()

    modes = {
        "plain": lambda t: plain.allreduce([t]).wait(),
        "plain_avg": lambda t: (plain.allreduce([t]).wait(), t.div_(n)),  # what DDP needs
        "ftar": ftar_step,
    }
    if tfm is not None:
        modes["torchft"] = tf_step
    out: dict = {m: {} for m in modes}
    out["quorum_ms"] = []
    for size in sizes:
        t = torch.ones(size // 4)
        ts: dict = {m: [] for m in modes}
        for k in range(iters[size] + 1):  # the first round warms up
            for m, fn in modes.items():
                if m == "ftar":
                    mgr.start_quorum()
                    mgr.wait_quorum()  # overlapped with forward in training: not on the clock
                    out["quorum_ms"].append(mgr.quorum_seconds * 1e3)
                elif m == "torchft":
                    assert tfm is not None
                    tfm.start_quorum()
                    tfm.wait_quorum()
                plain.barrier().wait()
                t0 = time.perf_counter()
                fn(t)
                if k:
                    ts[m].append(time.perf_counter() - t0)
        for m in modes:
            out[m][size] = statistics.median(ts[m])
    mgr.shutdown()
    if tfm is not None:
        tfm.shutdown(wait=False)
    q.put((i, out))


def bench_allreduce(sizes_mb: list[int], groups: list[int]) -> list[dict]:
    from ftcore.lighthouse import LighthouseConfig, serve

    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        LighthouseServer = None
    rows = []
    for n in groups:
        server, lh = serve(LighthouseConfig(bind="127.0.0.1:0", expected_replicas=n))
        addr = f"127.0.0.1:{server.server_address[1]}"
        tf = LighthouseServer(bind="[::]:0", min_replicas=n) if LighthouseServer else None
        sizes = [s * MB for s in sizes_mb]
        iters = {s: (10 if s <= 4 * MB else 6 if s <= 16 * MB else 4 if s <= 64 * MB else 3) for s in sizes}
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = free_port()
        procs = [
            ctx.Process(target=_ar_worker, args=(i, n, sizes, iters, port, addr, tf.address() if tf else None, q))
            for i in range(n)
        ]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in range(n):
                i, out = q.get(timeout=900)
                results[i] = out
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            lh.close()
            server.shutdown()
            if tf:
                tf.shutdown()
        for s in sizes:
            # the slowest group sets the pace of a synchronous step
            row: dict[str, Any] = {"groups": n, "size_mb": s // MB}
            for mode in ("plain", "plain_avg", "ftar", "torchft"):
                vals = [results[i].get(mode, {}).get(s) for i in range(n)]
                row[f"{mode}_ms"] = max(vals) * 1e3 if all(v is not None for v in vals) else None
            row["ftar_over_plain"] = row["ftar_ms"] / row["plain_ms"]
            row["ftar_over_plain_avg"] = row["ftar_ms"] / row["plain_avg_ms"]
            row["torchft_over_plain"] = row["torchft_ms"] / row["plain_ms"] if row["torchft_ms"] else None
            row["quorum_ms_median"] = statistics.median(results[0]["quorum_ms"])
            rows.append(row)
    return rows


# ---- 2./3. launcher runs -----------------------------------------------------------------------
def _launch(out: str, plan: list[dict], steps: int, step_sleep: float, spares: bool, ckpt: int, env: dict) -> dict:
    """The toy trainer, 3 groups, under `plan` (ckpt: checkpoint every so many steps, 0: none)."""
    options, args = toy(steps, step_sleep)
    args += ["--checkpoint-every", str(ckpt)] if ckpt else []
    return launch(
        out, plan, (options, args), options=["--max-restarts", "20", *([] if spares else ["--no-spares"])], env=env
    )


def failover_figures(tl: dict) -> dict:
    kills = [e for e in tl["launcher_events"] if e["kind"] == "fault" and e.get("fault") == "kill"]
    steps = [s for s in tl["steps"] if s["committed"]]
    by_group: dict[int, list[dict]] = {}
    for s in steps:
        by_group.setdefault(s["group"], []).append(s)
    for v in by_group.values():
        v.sort(key=lambda s: s["t"])
    gaps = [b["t"] - a["t"] for v in by_group.values() for a, b in zip(v, v[1:], strict=False)]
    step_s = statistics.median(gaps)
    failover, heal, stall = [], [], []
    for k in kills:
        tk, g = k["t"], k["group"]
        # survivors: the other groups that were training when the kill came
        survivors = [h for h in by_group if h != g and any(tk - 5 * step_s <= s["t"] <= tk for s in by_group[h])]
        firsts = []
        for h in survivors:
            after = [s["t"] for s in by_group[h] if s["t"] > tk]
            if after:
                firsts.append(after[0])
        if firsts:
            failover.append(max(firsts) - tk)
        killed = max((s["incarnation"] for s in by_group.get(g, []) if s["t"] <= tk), default=0)
        back = [s["t"] for s in by_group.get(g, []) if s["t"] > tk and s["incarnation"] > killed]
        if back:
            heal.append(back[0] - tk)
            # survivors' extra stall from the kill until the returning group's first commit
            for h in survivors:
                window = [s["t"] for s in by_group[h] if tk - step_s * 3 <= s["t"] <= back[0] + step_s]
                before = [s["t"] for s in by_group[h] if s["t"] <= tk]
                if window and before:
                    span = window[-1] - before[-1]
                    n = sum(1 for t in window if t > before[-1])
                    stall.append(max(span - n * step_s, 0.0))
    return {"step_s": step_s, "failover_samples_s": failover, "heal_samples_s": heal, "stall_samples_s": stall}


def bench_failover(kills: int, steps: int, spares: bool = True) -> dict:
    """spares=False: every restart is a cold start of a new process, as torchrun's (or a
    scheduler's) restart of a group is: imports, process group, heal."""
    with tempfile.TemporaryDirectory() as d:
        # far enough apart that the launcher has a warm spare again for each failure
        plan = [
            {"kind": "kill", "group": (k % 3), "at_step": 40 + 250 * k, "incarnation": k // 3} for k in range(kills)
        ]
        steps = max(steps, 40 + 250 * kills)
        tl = _launch(
            os.path.join(d, "failover"),
            plan,
            steps,
            0.03,
            spares,
            0,
            {"FTCORE_HEARTBEAT_TIMEOUT": "5.0", "FTCORE_COLLECTIVE_TIMEOUT": "10", "FTCORE_QUORUM_TIMEOUT": "20"},
        )
    fig = failover_figures(tl)
    fig["heartbeat_timeout_s"] = 5.0
    return fig


def bench_effective(kill_every_s: float, kills: int, steps: int) -> dict:
    """Same work (every bucket once), same kill schedule; effective = fault-free time / time taken."""
    res: dict[str, Any] = {}

    def span(tl: dict) -> float:
        starts = [e["t"] for e in tl["lighthouse_events"] if e["kind"] == "quorum_formed"]
        return max(s["t"] for s in tl["steps"]) - min(starts)

    with tempfile.TemporaryDirectory() as d:
        ref = _launch(os.path.join(d, "ref"), [], steps, 0.03, True, 25, {})
        res["fault_free_s"] = span(ref)
        for name, spares in (("ft_hsdp", True), ("restart_all", False)):
            plan = []
            for k in range(kills):
                at = 10.0 + kill_every_s * (k + 1)  # seconds after launch (startup takes ~10 s here)
                if name == "ft_hsdp":  # one machine fails: its replica group restarts alone
                    plan.append({"kind": "kill", "group": k % 3, "at_time": at, "incarnation": k // 3})
                else:  # torchrun-style: every group restarts from the last checkpoint
                    plan += [{"kind": "kill", "group": g, "at_time": at, "incarnation": k} for g in range(3)]
            tl = _launch(os.path.join(d, name), plan, steps, 0.03, spares, 25, {})
            fired = len({round(e["t"], 1) for e in tl["launcher_events"] if e["kind"] == "fault"})
            res[name] = {
                "wall_s": span(tl),
                "failures": fired,
                "committed_steps": len({s["step"] for s in tl["steps"] if s["committed"]}),
            }
            res[name]["effective"] = res["fault_free_s"] / res[name]["wall_s"]
    return res


def _med(xs):
    return statistics.median(xs) if xs else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/ftcore_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes and runs (a smoke test)")
    p.add_argument("--skip", default="", help="comma list of parts to skip: allreduce,failover,effective")
    p.add_argument("--groups", default="2,3", help="replica groups of the all-reduce part, e.g. 2,3,4")
    p.add_argument("--sizes", default="1,4,16,64,256", help="tensor sizes of the all-reduce part, MB")
    p.add_argument("--out", default=os.path.join(ROOT, "bench-results", "ftcore.json"))
    a = p.parse_args(argv)
    skip = set(a.skip.split(",")) - {""}
    result: dict = {
        "machine": f"{os.cpu_count()} cores",
        "torch": __import__("torch").__version__,
        "command": "python benchmarks/ftcore_bench.py" + (" --quick" if a.quick else ""),
    }
    if "allreduce" not in skip:
        sizes = [1, 16] if a.quick else [int(x) for x in a.sizes.split(",")]
        rows = bench_allreduce(sizes, [2] if a.quick else [int(x) for x in a.groups.split(",")])
        result["allreduce"] = rows
        print("\nall-reduce, median ms of the slowest group (FTAR includes the vote; quorum overlapped)")
        print(
            f"{'groups':>6} {'MB':>5} {'plain':>9} {'plain+div':>10} {'FTAR':>9} {'torchft':>9} {'FTAR/plain':>11} "
            f"{'FTAR/(plain+div)':>17} {'torchft/plain':>14}"
        )
        for r in rows:
            tf = f"{r['torchft_ms']:9.1f}" if r["torchft_ms"] else f"{'-':>9}"
            tfr = f"{r['torchft_over_plain']:14.2f}" if r["torchft_over_plain"] else f"{'-':>14}"
            print(
                f"{r['groups']:>6} {r['size_mb']:>5} {r['plain_ms']:9.1f} {r['plain_avg_ms']:10.1f} "
                f"{r['ftar_ms']:9.1f} {tf} {r['ftar_over_plain']:11.2f} {r['ftar_over_plain_avg']:17.2f} {tfr}"
            )
    if "failover" not in skip:
        fig = bench_failover(2 if a.quick else 4, 0)
        result["failover"] = fig
        result["failover_s"], result["heal_s"] = _med(fig["failover_samples_s"]), _med(fig["heal_samples_s"])
        result["stall_per_failure_s"] = _med(fig["stall_samples_s"])
        print(
            f"\nfailover/heal, 3 groups, toy step {fig['step_s'] * 1e3:.0f} ms, heartbeat timeout 5 s, "
            f"{len(fig['failover_samples_s'])} kill -9"
        )
        print(
            f"  kill -> survivors' next commit: median {result['failover_s']:.3f} s  {fmt(fig['failover_samples_s'])}"
        )
        if fig["heal_samples_s"]:
            print(
                f"  kill -> returning group's first commit: median {result['heal_s']:.3f} s  "
                f"{fmt(fig['heal_samples_s'])}"
            )
            print(
                f"  survivors' extra stall per failure: median {result['stall_per_failure_s']:.3f} s  "
                f"{fmt(fig['stall_samples_s'])}"
            )
        cold = bench_failover(2 if a.quick else 4, 0, spares=False)
        result["failover_cold"] = cold
        print(
            f"  cold restart (a new process, as torchrun restarts a group): kill -> returning group's first "
            f"commit: median {_med(cold['heal_samples_s']):.3f} s  {fmt(cold['heal_samples_s'])}; survivors' "
            f"extra stall median {_med(cold['stall_samples_s']):.3f} s"
        )
    if "effective" not in skip:
        eff = bench_effective(8.0 if a.quick else 10.0, 2 if a.quick else 3, 400 if a.quick else 800)
        result["effective"] = eff
        print(
            f"\neffective training time under a kill -9 schedule (3 groups, toy trainer; fault-free "
            f"{eff['fault_free_s']:.1f} s)"
        )
        for k in ("ft_hsdp", "restart_all"):
            e = eff[k]
            print(
                f"  {k:12s} failures {e['failures']:2d}  wall {e['wall_s']:6.1f} s  steps {e['committed_steps']}"
                f"  effective {e['effective'] * 100:5.1f}%"
            )
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    if skip and os.path.exists(a.out):  # keep the parts this run skipped from the last full run
        with open(a.out) as f:
            result = {**json.load(f), **result}
    atomic_write_json(a.out, layout(result), indent=1)
    print(f"\nwrote {a.out}")
    return 0


def layout(result: dict) -> dict:
    """The scale model reads the first match of each key: put the medians it wants first."""
    head = {k: result[k] for k in ("failover_s", "heal_s", "stall_per_failure_s") if k in result}
    big = [r["ftar_over_plain"] for r in result.get("allreduce", []) if r["size_mb"] >= 16]
    if big:
        # FTAR's extra time over a plain all-reduce at >= 16 MB: an upper bound on the step
        # overhead (communication is only part of a step).
        head["step_overhead"] = max(0.0, statistics.median(big) - 1.0)
    return {**head, **{k: v for k, v in result.items() if k not in head}}


def fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"


if __name__ == "__main__":
    sys.exit(main())
