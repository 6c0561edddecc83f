"""Discrete-event model of one training job under failures: synchronous vs FT-HSDP.

Both modes run on the same machinery, a piecewise-constant timeline of progress:

- A replica group is *down* from the failure of one of its units until its
  recovery ends: detection + rescheduling + state load + communicator init +
  first step. The state comes from a live peer (`fthsdp.heal_s`) when another
  group is up at the failure, else from the last checkpoint (`restart.ckpt_load_s`).
- A failure while the group is still recovering either queues a recovery of its
  own (`failures.overlap = "queue"`: it surfaces when the ongoing restart reaches
  rendezvous, and a new restart follows) or restarts the ongoing one ("restart").
- FT-HSDP: a failure of a live group stalls every group for detect + reconfigure
  (quorum change); a healed group joining live peers may cost `join_stall_s`.
  Stalls are handled one at a time by the control plane (or restart, as above).
- Between stalls the job steps when at least `min_replicas` groups are live, and
  makes progress at the live share of its GPUs (`progress = "samples"`) or at the
  LR policy's scale of that share (`progress = "lr"`, see README.md).
- When every group is down the live state is gone: the job rolls back to its last
  checkpoint, losing the progress made since (checkpoints every `interval_s` of
  training time; a blocking write of `write_s` per checkpoint slows progress by
  interval/(interval+write)).
- Synchronous training is the same job as a single group: every failure takes the
  whole job down for detection + the full restart from the checkpoint, and loses
  the work since that checkpoint.

Effective training time (ETT) = progress kept / wall-clock time, 1.0 = all GPUs
stepping all the time. Everything but the per-failure recovery bookkeeping (a short
Python loop over failures) is vectorized with numpy.
"""

import math

import numpy as np

from benchmarks.sim.config import SimConfig
from benchmarks.sim.failures import Failures, draw, job_mtbf_s

MODES = ("sync", "fthsdp")


def checkpoint_interval(cfg: SimConfig) -> float:
    """Training time between checkpoints: fixed, or Daly's optimum for the job's MTBF.

    Daly (2006), higher-order estimate: tau = sqrt(2 d M) [1 + sqrt(d/2M)/3 + (d/2M)/9] - d
    for d < 2M, else M (d = blocking write time, M = job MTBF). A free write (d = 0)
    gives 0: checkpoint every step, nothing to lose.
    """
    c = cfg.checkpoint
    if c.policy == "fixed":
        return c.interval_s
    d, m = c.write_s, job_mtbf_s(cfg)
    if d == 0:
        return 0.0
    if math.isinf(m):
        return math.inf
    if d >= 2 * m:
        return m
    x = d / (2 * m)
    return math.sqrt(2 * d * m) * (1 + math.sqrt(x) / 3 + x / 9) - d


def lr_scale(policy: str, live: np.ndarray) -> np.ndarray:
    """LR multiplier with a live share `live` of the replica groups."""
    if policy == "sqrt":
        return np.sqrt(live)
    if policy == "linear":
        return live
    return np.ones_like(live)


def _recoveries(t, group, detect, n_groups, restart_s, heal_s, load_s, reconfigure_s, queue):
    """Walk the failures in time order. Returns the down intervals (start, end, group)
    and the stalls they trigger (time, duration) for failures of live groups."""
    until = [-math.inf] * n_groups  # each group is down until then
    since = [None] * n_groups  # start of its current (or last) down interval
    down, stalls = [], []  # (start, end, group), (time, duration)
    for ti, gi, di in zip(t.tolist(), group.tolist(), detect.tolist(), strict=True):
        u = until[gi]
        if u <= ti:  # the group was live: it leaves the job now
            if since[gi] is not None:
                down.append((since[gi], u, gi))
            since[gi] = ti
            if reconfigure_s is not None:
                stalls.append((ti, di + reconfigure_s))
        peer = n_groups > 1 and any(until[j] <= ti for j in range(n_groups) if j != gi)
        rec = di + restart_s + (heal_s if peer else load_s)
        until[gi] = (max(ti, u) if queue else ti) + rec
    down += [(since[g], until[g], g) for g in range(n_groups) if since[g] is not None]
    d = np.array(down, float).reshape(-1, 3)
    s = np.array(stalls, float).reshape(-1, 2)
    return d[:, 0], d[:, 1], d[:, 2].astype(np.int64), s[:, 0], s[:, 1]


def _busy(at: np.ndarray, dur: np.ndarray, queue: bool) -> np.ndarray:
    """End of each stall, the stalls served one at a time (Lindley's recursion,
    e_k = max(a_k, e_{k-1}) + d_k, in closed form) or each cut short by the next."""
    if queue:
        c = np.cumsum(dur)
        return c + np.maximum.accumulate(at - (c - dur))
    end = at + dur
    end[:-1] = np.minimum(end[:-1], at[1:])
    return end


def _count(sorted_starts, sorted_ends, x):
    return np.searchsorted(sorted_starts, x, "right") - np.searchsorted(sorted_ends, x, "right")


def simulate(cfg: SimConfig, mode: str, seed: int | None = None, fails: Failures | None = None) -> dict:
    """One run of `mode` ("sync" or "fthsdp"). Returns ETT and where the rest went,
    as fractions of wall-clock time, and the count of failures."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose one of {MODES}")
    if fails is None:
        fails = draw(cfg, cfg.job.seed if seed is None else seed)
    H, rs, ft = fails.horizon, cfg.restart, cfg.fthsdp
    queue = cfg.failures.overlap == "queue"
    restart_s = rs.reschedule_s + rs.comm_init_s + rs.first_step_s
    if mode == "sync":
        weights, group, min_rep, detect = np.ones(1), np.zeros(len(fails.t), np.int64), 1, fails.detect
        reconfigure, join_s, overhead = None, 0.0, 0.0
    else:
        weights, group, min_rep, detect = fails.weights, fails.group, ft.min_replicas, fails.ft_detect
        reconfigure, join_s, overhead = ft.reconfigure_s, ft.join_stall_s, ft.step_overhead
    n_groups = len(weights)
    ds, de, dg, st_at, st_dur = _recoveries(
        fails.t, group, detect, n_groups, restart_s, ft.heal_s, rs.ckpt_load_s, reconfigure, queue
    )
    s_sorted, e_sorted = np.sort(ds), np.sort(de)

    if join_s > 0 and n_groups > 1:  # a healed group joining live peers stalls them briefly
        back = de[de < H]
        back = back[n_groups - 1 - _count(s_sorted, e_sorted, back) > 0]
        st_at, st_dur = np.append(st_at, back), np.append(st_dur, np.full(len(back), join_s))
    order = np.argsort(st_at, kind="stable")
    st_at, st_dur = st_at[order], st_dur[order]
    st_end = _busy(st_at, st_dur, queue)

    # the timeline: constant state between consecutive breakpoints
    b = np.unique(np.concatenate([[0.0, H], ds, np.minimum(de, H), st_at, np.minimum(st_end, H)]))
    b = b[b <= H]
    dt, mid = np.diff(b), (b[:-1] + b[1:]) / 2
    n_down = _count(s_sorted, e_sorted, mid)
    ws = np.concatenate([[0.0], np.cumsum(weights[dg][np.argsort(ds, kind="stable")])])
    we = np.concatenate([[0.0], np.cumsum(weights[dg][np.argsort(de, kind="stable")])])
    w_down = ws[np.searchsorted(s_sorted, mid, "right")] - we[np.searchsorted(e_sorted, mid, "right")]
    stalled = _count(st_at, np.sort(st_end), mid) > 0
    live = n_groups - n_down
    running = ~stalled & (live >= min_rep)
    share = np.clip(1.0 - w_down, 0.0, 1.0)
    value = share if ft.progress == "samples" or mode == "sync" else lr_scale(ft.lr_policy, share)
    tau, write = checkpoint_interval(cfg), cfg.checkpoint.write_s
    if mode == "fthsdp" and cfg.checkpoint.fthsdp_interval_s > 0:
        tau = cfg.checkpoint.fthsdp_interval_s
    period = tau + write
    eff = tau / period if period > 0 and math.isfinite(period) else 1.0
    rate = running * value * eff * (1 - overhead)
    TT = np.concatenate([[0.0], np.cumsum(dt * running)])  # training (stepping) time
    P = np.concatenate([[0.0], np.cumsum(dt * rate)])  # progress

    # every group down: roll back to the last checkpoint, counted in training time
    # since the previous restore (a restore starts from a checkpoint)
    alldown = live == 0
    first = np.flatnonzero(alldown & ~np.concatenate([[False], alldown[:-1]]))
    lost = 0.0
    if len(first):
        at = TT[first]
        since = at - np.concatenate([[0.0], at[:-1]])
        if period == 0:
            lost_tt = np.zeros_like(since)
        elif math.isinf(period):
            lost_tt = since
        else:
            lost_tt = np.mod(since, period)
        c = at - lost_tt
        k = np.clip(np.searchsorted(TT, c, "right") - 1, 0, len(rate) - 1)
        lost = float(np.sum(P[first] - (P[k] + (c - TT[k]) * rate[k])))

    n = len(fails.t)
    stall_f = float(np.sum(dt * ~running)) / H
    rollback_f = lost / H
    return {
        "ett": (float(P[-1]) - lost) / H,
        "failures": n,
        "stalled": stall_f,  # no group stepping
        "degraded": float(np.sum(dt * running * (1 - value))) / H,  # stepping without every group
        "checkpoint": float(np.sum(dt * running * value * (1 - eff))) / H,
        "overhead": float(np.sum(dt * running * value * eff * overhead)) / H,  # FT step protocol
        "rollback": rollback_f,  # progress lost to restores
        "groups_down": float(np.sum(dt * n_down)) / H,  # time-average
        "stall_per_failure_min": (stall_f + rollback_f) * H / max(n, 1) / 60,
        "checkpoint_interval_s": tau,
    }
