"""Runs, sweeps and the report: table, JSON and PNG plots.

Every figure is a mean over seeds with a 95% confidence interval (Student t).
Synchronous and FT-HSDP runs of one seed share their failure draws, so their
difference is measured with less noise than either figure alone.
"""

import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.sim import balance, calibration
from benchmarks.sim.config import FailureKind, SimConfig, validate, with_
from benchmarks.sim.engine import MODES, simulate
from benchmarks.sim.failures import draw, job_mtbf_s, units
from ftcore.util.files import atomic_write_text, atomic_writer

PAPER: dict[str, Any] = {
    "gpus": 98_304,
    "replica_groups": 12,
    "mtbf_min": 18.0,
    "stall_min": {"sync": 10.0, "fthsdp": 3.0},
    "ett": {"sync": 0.44, "fthsdp": 0.80},
    "tolerance": 0.02,
    "source": "Salpekar et al., Training LLMs with Fault Tolerant HSDP on 100,000 GPUs, arXiv 2602.00277",
}
METRICS = (
    "ett",
    "stalled",
    "degraded",
    "rollback",
    "checkpoint",
    "overhead",
    "groups_down",
    "stall_per_failure_min",
    "failures",
)
_T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    12: 2.179,
    15: 2.131,
    20: 2.086,
    30: 2.042,
}


def summary(values) -> dict:
    x = np.asarray(values, float)
    n = len(x)
    if n < 2:
        return {"mean": float(x.mean()), "ci95": 0.0, "n": n}
    t = _T975[max(k for k in _T975 if k <= n - 1)] if n - 1 <= 30 else 1.96
    return {"mean": float(x.mean()), "ci95": float(t * x.std(ddof=1) / math.sqrt(n)), "n": n}


def run(cfg: SimConfig, modes=MODES, seeds: int | None = None) -> dict:
    """{mode: {metric: summary}} over seeds job.seed .. job.seed + seeds - 1."""
    seeds = cfg.job.seeds if seeds is None else seeds
    raw: dict[str, list[dict]] = {m: [] for m in modes}
    for s in range(cfg.job.seed, cfg.job.seed + seeds):
        fails = draw(cfg, s)
        for m in modes:
            raw[m].append(simulate(cfg, m, fails=fails))
    return {m: {k: summary([r[k] for r in rs]) for k in METRICS} for m, rs in raw.items()}


def _ett(res: dict, mode: str) -> dict:
    return {"mean": res[mode]["ett"]["mean"], "ci95": res[mode]["ett"]["ci95"]}


def _at_scale(cfg: SimConfig, gpus: int, groups: int) -> SimConfig:
    gps = cfg.job.gpus_per_server
    gpus = max(gps, round(gpus / gps) * gps)
    n_units = gpus // gps if cfg.failures.unit == "server" else gpus
    groups = max(1, min(groups, n_units))
    return with_(
        cfg, job_gpus=gpus, job_replica_groups=groups, fthsdp_min_replicas=min(cfg.fthsdp.min_replicas, groups)
    )


def sweep_scale(cfg: SimConfig, seeds: int, cal: dict) -> list:
    """ETT against job size; the per-unit failure rate is fixed, so the job's rate grows
    with it. FT-HSDP with replica groups of fixed size, with a fixed group count, and
    with ftrec's measured mechanism (fixed group size)."""
    rows = []
    for g in cfg.sweep.scales:
        fixed_size = _at_scale(cfg, g, max(1, round(g / cfg.sweep.group_gpus)))
        fixed_count = _at_scale(cfg, g, cfg.job.replica_groups)
        a = run(fixed_size, seeds=seeds)
        b = run(fixed_count, ("fthsdp",), seeds=seeds)
        c = run(ftrec_config(fixed_size, cal), ("fthsdp",), seeds=seeds)
        rows.append(
            {
                "gpus": fixed_size.job.gpus,
                "mtbf_min": job_mtbf_s(fixed_size) / 60,
                "groups": fixed_size.job.replica_groups,
                "sync": _ett(a, "sync"),
                "fthsdp": _ett(a, "fthsdp"),
                "fthsdp_fixed_groups": _ett(b, "fthsdp"),
                "fixed_groups": fixed_count.job.replica_groups,
                "fthsdp_ftrec": _ett(c, "fthsdp"),
            }
        )
    return rows


# How the paper check moves with the assumptions that its inputs do not pin (README.md).
SENSITIVITY: list[tuple[str, dict[str, Any]]] = [
    ("preset: restart 9 min + checkpoint every 4 min; group back after 9 min", {}),
    ("a failure during a restart restarts it (overlap = restart)", {"failures_overlap": "restart"}),
    ("checkpoint every 2 min", {"checkpoint_interval_s": 120.0}),
    ("checkpoint every 8 min", {"checkpoint_interval_s": 480.0}),
    ("restart 10 min, checkpoint every 1 min", {"restart_reschedule_s": 240.0, "checkpoint_interval_s": 60.0}),
    ("replica group back after 7 min (heal from peer instant)", {"fthsdp_heal_s": 0.0}),
    ("replica group back after 13 min (heal 6 min)", {"fthsdp_heal_s": 360.0}),
    (
        "hangs detected after 10 min (NCCL-style timeout)",
        {"failures_kinds": [FailureKind("crash", 0.8, 30.0), FailureKind("hang", 0.2, 600.0)]},
    ),
]


def sensitivity(base: SimConfig, preset: dict) -> list:
    rows = []
    for label, changes in SENSITIVITY:
        res = run(validate(with_(base, **changes))) if changes else preset
        rows.append(
            {
                "assumption": label,
                "sync": _ett(res, "sync"),
                "fthsdp": _ett(res, "fthsdp"),
                "stall_min": {m: res[m]["stall_per_failure_min"]["mean"] for m in MODES},
            }
        )
    return rows


def sweep_groups(cfg: SimConfig, seeds: int) -> list:
    rows = []
    for r in cfg.sweep.replica_groups:
        if r > units(cfg):
            continue
        c = with_(cfg, job_replica_groups=r, fthsdp_min_replicas=min(cfg.fthsdp.min_replicas, r))
        res = run(c, seeds=seeds)
        rows.append(
            {
                "groups": r,
                "group_gpus": cfg.job.gpus / r,
                "sync": _ett(res, "sync"),
                "fthsdp": _ett(res, "fthsdp"),
                "fthsdp_degraded": res["fthsdp"]["degraded"]["mean"],
                "fthsdp_stalled": res["fthsdp"]["stalled"]["mean"],
            }
        )
    return rows


def sweep_rate(cfg: SimConfig, seeds: int) -> list:
    rows = []
    for m in cfg.sweep.mtbf_min:
        c = with_(cfg, failures_unit_mtbf_h=m * units(cfg) / 60)
        res = run(c, seeds=seeds)
        rows.append(
            {"mtbf_min": m, "failures_per_day": 1440 / m, "sync": _ett(res, "sync"), "fthsdp": _ett(res, "fthsdp")}
        )
    return rows


def sweep_bubbles(cfg: SimConfig, cost: dict, source) -> dict:
    b = cfg.balance
    rng = np.random.default_rng(cfg.job.seed)
    rows = []
    for w in b.world_sizes:
        r = balance.bubbles(
            w,
            batch=b.batch_per_rank,
            window=b.window_steps,
            windows=b.windows,
            cost=cost,
            rng=rng,
            source=source,
            median=b.lognormal_median,
            sigma=b.lognormal_sigma,
            max_len=b.max_len,
        )
        rows.append({"world_size": w, **r})
    return {
        "lengths": b.lengths,
        "batch_per_rank": b.batch_per_rank,
        "window_steps": b.window_steps,
        "cost_model": cost,
        "rows": rows,
    }


def ftrec_config(cfg: SimConfig, cal: dict) -> SimConfig:
    o = calibration.ftrec_overrides(cal)
    det = o.pop("ft_detect")
    kinds = [replace(k, ft_detect_s=det.get(k.name, k.ft_detect_s)) for k in cfg.failures.kinds]
    return validate(with_(with_(cfg, **o), failures_kinds=kinds))


def build(cfg: SimConfig, bench_dir: Path, shared_dir: Path, sweeps: bool = True) -> dict:
    t0 = time.perf_counter()
    b = cfg.balance
    source = balance.lengths_source(b.lengths, shared_dir, b.max_len)  # fail early on a bad path
    cal = calibration.load(bench_dir)
    paper_cfg = with_(SimConfig(), job_seeds=cfg.job.seeds, job_seed=cfg.job.seed)
    paper = run(paper_cfg)
    main = run(cfg)
    ftrec = run(ftrec_config(cfg, cal), ("fthsdp",))
    cost = (
        {"a": b.cost_a, "b": b.cost_b, "c0": b.cost_c0}
        if min(b.cost_a, b.cost_b, b.cost_c0) >= 0
        else {k: cal["cost_model"][k] for k in ("a", "b", "c0")}
    )
    t_main = time.perf_counter() - t0
    out = {
        "config": cfg.to_dict(),
        "job": {
            "gpus": cfg.job.gpus,
            "replica_groups": cfg.job.replica_groups,
            "units": units(cfg),
            "mtbf_min": job_mtbf_s(cfg) / 60,
            "days": cfg.job.days,
            "seeds": cfg.job.seeds,
        },
        "results": main,
        "ftrec": {"fthsdp": ftrec["fthsdp"], "calibration": cal},
        "paper": {
            "published": PAPER,
            "model": paper,
            "within_tolerance": {
                m: abs(paper[m]["ett"]["mean"] - PAPER["ett"][m]) <= PAPER["tolerance"] for m in MODES
            },
        },
        "seconds": {"main": round(t_main, 3)},
    }
    if sweeps:
        seeds = max(2, min(cfg.job.seeds, 4))  # sweeps: fewer seeds per point, CIs still reported
        t1 = time.perf_counter()
        out["sweeps"] = {
            "seeds": seeds,
            "scale": sweep_scale(cfg, seeds, cal),
            "groups": sweep_groups(cfg, seeds),
            "rate": sweep_rate(cfg, seeds),
        }
        out["paper"]["sensitivity"] = sensitivity(paper_cfg, paper)
        out["bubbles"] = sweep_bubbles(cfg, cost, source)
        out["seconds"]["sweeps"] = round(time.perf_counter() - t1, 3)
    return out


def _pct(s: dict) -> str:
    return f"{100 * s['mean']:5.1f} ± {100 * s['ci95']:.1f}%"


def table(rep: dict) -> str:
    j, r, p = rep["job"], rep["results"], rep["paper"]
    lines = [
        f"Scale model: {j['gpus']:,} GPUs as {j['replica_groups']} replica groups, a failure every "
        f"{j['mtbf_min']:.1f} min, {j['days']:g} days x {j['seeds']} seeds (mean ± 95% CI)",
        "",
    ]
    head = f"{'':34}{'synchronous':>16}{'FT-HSDP':>16}{'FT-HSDP (ftrec)':>18}"
    lines += [head, "-" * len(head)]
    f = rep["ftrec"]["fthsdp"]
    rows = [
        ("effective training time", "ett", True),
        ("stalled (no group stepping)", "stalled", True),
        ("degraded (groups down)", "degraded", True),
        ("rolled back to checkpoint", "rollback", True),
        ("checkpoint writes", "checkpoint", True),
        ("FT step overhead", "overhead", True),
        ("stall per failure (min)", "stall_per_failure_min", False),
        ("failures", "failures", False),
    ]
    for label, k, pct in rows:
        cells = [r["sync"][k], r["fthsdp"][k], f[k]]
        fmt = _pct if pct else (lambda s: f"{s['mean']:9.1f}      ")
        lines.append(f"{label:34}{fmt(cells[0]):>16}{fmt(cells[1]):>16}{fmt(cells[2]):>18}")
    pub, mod = p["published"], p["model"]
    lines += [
        "",
        "Paper check (default preset: 98,304 GPUs, 12 groups, failure every 18 min):",
        f"  synchronous  model {_pct(mod['sync']['ett'])}  published {100 * pub['ett']['sync']:.0f}%  "
        f"stall/failure model {mod['sync']['stall_per_failure_min']['mean']:.1f} min, published 10 min  "
        f"{'OK' if p['within_tolerance']['sync'] else 'OFF'} (±2 points)",
        f"  FT-HSDP      model {_pct(mod['fthsdp']['ett'])}  published {100 * pub['ett']['fthsdp']:.0f}%  "
        f"stall/failure model {mod['fthsdp']['stall_per_failure_min']['mean']:.1f} min, published 3 min  "
        f"{'OK' if p['within_tolerance']['fthsdp'] else 'OFF'} (±2 points)",
    ]
    cal = rep["ftrec"]["calibration"]["ftcore"]
    lines.append(
        "  ftrec column: FT-HSDP with ftrec's measured mechanism: "
        + ", ".join(f"{k}={v['value']:g}" + (" (default)" if v["source"] == "default" else "") for k, v in cal.items())
    )
    if "sensitivity" in p:
        lines += ["", "  What the paper's inputs leave open, and how the check moves (sync / FT-HSDP ETT):"]
        for x in p["sensitivity"]:
            lines.append(f"    {x['assumption']:68} {_pct(x['sync']):>13} {_pct(x['fthsdp']):>13}")
    if "sweeps" in rep:
        sw = rep["sweeps"]
        lines += [
            "",
            f"ETT vs scale (replica groups of {rep['config']['sweep']['group_gpus']:,} GPUs; {sw['seeds']} seeds):",
            f"  {'GPUs':>8} {'MTBF min':>9} {'groups':>6} {'sync':>14} {'FT-HSDP':>14} "
            f"{'FT-HSDP R=' + str(sw['scale'][0]['fixed_groups']):>14} {'FT-HSDP ftrec':>14}",
        ]
        for x in sw["scale"]:
            lines.append(
                f"  {x['gpus']:>8,} {x['mtbf_min']:>9.1f} {x['groups']:>6} {_pct(x['sync']):>14} "
                f"{_pct(x['fthsdp']):>14} {_pct(x['fthsdp_fixed_groups']):>14} "
                f"{_pct(x['fthsdp_ftrec']):>14}"
            )
        lines += [
            "",
            f"ETT vs replica-group count at {j['gpus']:,} GPUs:",
            f"  {'groups':>6} {'GPUs/group':>10} {'sync':>14} {'FT-HSDP':>14} {'FT stalled':>11} {'FT degraded':>12}",
        ]
        for x in sw["groups"]:
            lines.append(
                f"  {x['groups']:>6} {x['group_gpus']:>10,.0f} {_pct(x['sync']):>14} "
                f"{_pct(x['fthsdp']):>14} {100 * x['fthsdp_stalled']:>10.1f}% "
                f"{100 * x['fthsdp_degraded']:>11.1f}%"
            )
        lines += [
            "",
            f"ETT vs failure rate at {j['gpus']:,} GPUs:",
            f"  {'MTBF min':>9} {'per day':>8} {'sync':>14} {'FT-HSDP':>14}",
        ]
        for x in sw["rate"]:
            lines.append(
                f"  {x['mtbf_min']:>9g} {x['failures_per_day']:>8.0f} {_pct(x['sync']):>14} {_pct(x['fthsdp']):>14}"
            )
        bb = rep["bubbles"]
        lines += [
            "",
            f"Bubble fraction vs W ({bb['lengths']} lengths, {bb['batch_per_rank']} samples per rank, "
            f"window {bb['window_steps']} steps; c(L) = {bb['cost_model']['a']:g} L^2 + "
            f"{bb['cost_model']['b']:g} L + {bb['cost_model']['c0']:g}):",
            f"  {'W':>6} {'random':>8} {'per-step LPT':>13} {'balanced':>9} {'bubble removed':>15}",
        ]
        for x in bb["rows"]:
            lines.append(
                f"  {x['world_size']:>6} {100 * x['random']:>7.1f}% {100 * x['per_step_lpt']:>12.1f}% "
                f"{100 * x['balanced']:>8.2f}% {100 * (1 - x['balanced'] / max(x['random'], 1e-12)):>14.1f}%"
            )
    return "\n".join(lines)


def write_json(rep: dict, path: Path) -> None:
    atomic_write_text(path, json.dumps(rep, indent=2, default=float) + "\n")


def plots(rep: dict, out: Path) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        path = out / name
        with atomic_writer(path, "wb") as f:
            fig.savefig(f, dpi=110, bbox_inches="tight", format="png")
        plt.close(fig)
        written.append(str(path))

    def line(ax, x, rows, key, label, **kw):
        m = np.array([100 * r[key]["mean"] for r in rows])
        e = np.array([100 * r[key]["ci95"] for r in rows])
        ax.errorbar(x, m, yerr=e, marker="o", ms=4, capsize=3, label=label, **kw)

    both: list[tuple[str, str, dict[str, Any]]] = [("sync", "synchronous", {}), ("fthsdp", "FT-HSDP", {})]

    def ett_plot(name, rows, x, xlabel, title, series=None, published=False):
        """Effective training time against rows' `x` (log scale): per series (key, label, line
        style) its mean with the 95% CI; synchronous and FT-HSDP unless `series` says otherwise."""
        fig, ax = plt.subplots(figsize=(7, 4.2))
        xs = [r[x] for r in rows]
        for key, label, kw in series or both:
            line(ax, xs, rows, key, label, **kw)
        if published:
            ax.scatter(
                [pub["gpus"]] * 2,
                [100 * pub["ett"]["sync"], 100 * pub["ett"]["fthsdp"]],
                marker="*",
                s=140,
                color="k",
                zorder=5,
                label="published (FT-HSDP paper)",
            )
        ax.set(xscale="log", xlabel=xlabel, ylabel="effective training time (%)", ylim=(0, 102), title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, name)

    sw, pub = rep["sweeps"], rep["paper"]["published"]
    ett_plot(
        "sim-ett-vs-scale.png",
        sw["scale"],
        "gpus",
        "GPUs",
        "Effective training time vs scale",
        [
            ("sync", "synchronous", {}),
            ("fthsdp", f"FT-HSDP, groups of {rep['config']['sweep']['group_gpus']:,} GPUs", {}),
            ("fthsdp_fixed_groups", f"FT-HSDP, {sw['scale'][0]['fixed_groups']} groups", {"ls": "--"}),
            ("fthsdp_ftrec", "FT-HSDP with ftrec's measured failover/heal", {"ls": ":"}),
        ],
        published=True,
    )
    ett_plot(
        "sim-ett-vs-groups.png",
        sw["groups"],
        "groups",
        f"replica groups ({rep['job']['gpus']:,} GPUs)",
        "Effective training time vs replica groups",
    )
    ett_plot(
        "sim-ett-vs-failure-rate.png",
        sw["rate"],
        "failures_per_day",
        f"failures per day ({rep['job']['gpus']:,} GPUs)",
        "Effective training time vs failure rate",
    )

    bb = rep["bubbles"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [r["world_size"] for r in bb["rows"]]
    for key, label in (
        ("random", "random"),
        ("per_step_lpt", "per-step LPT"),
        ("balanced", f"balanced (window {bb['window_steps']} steps)"),
    ):
        ax.plot(xs, [100 * r[key] for r in bb["rows"]], marker="o", ms=4, label=label)
    ax.set(
        xscale="log",
        xlabel="data-parallel ranks W",
        ylabel="bubble fraction (%)",
        title=f"Per-step bubbles, {bb['lengths']} lengths, {bb['batch_per_rank']} samples per rank",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "sim-bubble-vs-world.png")
    return written
