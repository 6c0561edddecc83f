"""Calibration from ftrec's own measurements, read from benchmark JSON files.

The model takes ftrec's balancer and default cost model from dataprep (balance.py) and
imports nothing of training; the measurements it reads from what the benchmarks wrote:

- bench-results/ftcore.json: `failover_s` (a crashed peer -> the survivors step
  again), `heal_s` (a restarted replica fetches the live state and rejoins),
  `stall_per_failure_s` (what the healthy replicas lose per failure), and, if
  present there or in training.json, `step_overhead` (fraction of step time the
  FT step protocol adds);
- bench-results/dataprep.json (or training.json): a cost model {a, b, c0};
- bench-results/training.json: a per-step time, reported for reference.

Keys are found wherever they sit in the file (first match, depth first); a value
may be a number or a summary {median|p50|mean: number}. Absent files or keys fall
back to the documented defaults below, and the report says which was used.
"""

import json
from pathlib import Path
from typing import Any

from benchmarks.sim.balance import default_cost
from ftcore.timeouts import HEARTBEAT_TIMEOUT

# Used when bench-results/ftcore.json is absent: deliberately conservative round figures
# (a SIGKILLed peer surfaces in ~25 ms and a fresh gloo group builds in <10 ms on the CPU
# machines of BENCHMARKS.md; a quorum round trip and a retried step make it about half a second).
DEFAULT_FTCORE = {"failover_s": 0.5, "heal_s": 2.0, "stall_per_failure_s": 0.5, "step_overhead": 0.0}
STEP_KEYS = ("step_s", "step_time_s", "s_per_step", "seconds_per_step")


def _number(v):
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, dict):
        for k in ("median", "p50", "mean"):
            if isinstance(v.get(k), (int, float)) and not isinstance(v.get(k), bool):
                return float(v[k])
    return None


def _first(obj, pick):
    """The first non-None pick(node) over a JSON tree, depth first, or None."""
    found = pick(obj)
    if found is not None:
        return found
    children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()
    for c in children:
        v = _first(c, pick)
        if v is not None:
            return v
    return None


def find(obj, key):
    """First numeric value under `key` anywhere in a JSON tree, or None."""
    return _first(obj, lambda o: _number(o.get(key)) if isinstance(o, dict) and key in o else None)


def _cost_model(o):
    if not isinstance(o, dict):
        return None
    vals = [_number(o.get(k)) for k in ("a", "b", "c0")]
    if all(v is not None and v >= 0 for v in vals) and sum(vals) > 0:
        return dict(zip(("a", "b", "c0"), vals, strict=True))
    return None


def find_cost_model(obj):
    """First {a, b, c0} table of numbers >= 0 anywhere in a JSON tree, or None."""
    return _first(obj, _cost_model)


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load(bench_dir: Path) -> dict:
    """What ftrec measured (or the defaults), each value with its source."""
    bench_dir = Path(bench_dir)
    out: dict[str, Any] = {"ftcore": {}, "cost_model": None, "step_s": None}
    ft, tr = _read(bench_dir / "ftcore.json"), _read(bench_dir / "training.json")
    for k, default in DEFAULT_FTCORE.items():
        out["ftcore"][k] = {"value": default, "source": "default"}
        for name, doc in (("ftcore.json", ft), ("training.json", tr)):
            v = find(doc, k) if doc is not None else None
            if v is not None and 0 <= v and (k != "step_overhead" or v < 1):  # else: not a usable measurement
                out["ftcore"][k] = {"value": v, "source": str(bench_dir / name)}
                break
    for name in ("training.json", "dataprep.json"):
        cm = find_cost_model(_read(bench_dir / name))
        if cm is not None:
            out["cost_model"] = {**cm, "source": str(bench_dir / name)}
            break
    else:
        out["cost_model"] = {**default_cost(), "source": "default (dataprep.cost.DEFAULT)"}
    for k in STEP_KEYS:
        v = find(tr, k) if tr is not None else None
        if v is not None:
            out["step_s"] = {"value": v, "source": str(bench_dir / "training.json"), "key": k}
            break
    return out


def ftrec_overrides(cal: dict) -> dict:
    """FT-HSDP settings that swap the paper's mechanism for ftrec's measured one.

    The cluster side (failure rate, rescheduling, communicator init, first step)
    stays as configured. A crash is acted on by ftrec's data plane at once, so its
    detection is inside the measured failover; a hang waits for ftcore's heartbeat
    timeout. The survivors' stall is the measured failover plus, when a healed
    replica joins, the rest of the measured stall per failure.
    """
    f = {k: v["value"] for k, v in cal["ftcore"].items()}
    return {
        "fthsdp_reconfigure_s": f["failover_s"],
        "fthsdp_join_stall_s": max(0.0, f["stall_per_failure_s"] - f["failover_s"]),
        "fthsdp_heal_s": f["heal_s"],
        "fthsdp_step_overhead": f["step_overhead"],
        "ft_detect": {"crash": 0.0, "hang": HEARTBEAT_TIMEOUT},
    }
