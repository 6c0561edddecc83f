"""The GPU claims of BENCHMARKS.md ("GPU claims"), each a PASS / FAIL / SKIP line with its figure,
judged from the parts of benchmarks/gpu_check.py; and part 2 of the check (`part_table`): the
trainer with the sharded item table and the row-wise optimizer on the device, then bf16 against
float32 full-ranking evaluation of its model on the device.

On CPU (--cpu) a claim about CUDA is SKIP with its reason, or FAIL when its code path failed even
there; a claim one GPU cannot show says so and what one GPU measured instead.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

CPU_SKIP = "GPU-only: the code path ran on CPU and passed there; the claim needs CUDA"


@dataclass
class Claim:
    claim: str
    status: str  # PASS | FAIL | SKIP
    figure: str
    note: str = ""


def _judge(text: str, ok: bool, figure: str, gpus: int, note: str = "") -> Claim:
    """A claim about CUDA: PASS/FAIL on a GPU; on CPU SKIP when its path passed, else FAIL."""
    if gpus:
        return Claim(text, "PASS" if ok else "FAIL", figure, note)
    return Claim(text, "SKIP" if ok else "FAIL", figure, CPU_SKIP if ok else note)


# ---- 2. table: the sharded table and the row-wise optimizer on the device, bf16 evaluation -----


def _launch(work: Path, shards: str, ranks: int, gpus: int, budget: float, sets: list[str]) -> tuple[int, str]:
    from benchmarks.gpu_check import _run

    argv = [sys.executable, "-m", "training", "launch", "--shards", shards, "--replica-groups", "1"]
    argv += ["--ranks-per-group", str(ranks), "--out", str(work / "dev-run"), "--timeout", str(int(budget - 10))]
    return _run([*argv, "--", "--set", *sets], budget, {"OMP_NUM_THREADS": "1"})


def _eval_both(result: dict, shards: str, device: torch.device) -> dict:
    """Full ranking of the run's final model on `device`, float32 and bf16: the metrics of each."""
    import dataclasses

    from training import checkpoint
    from training.config import config_from_dict
    from training.data import ShardSet
    from training.evaluate import EvalData, evaluate
    from training.model import SeqRec

    path = result["checkpoint"]
    cfg = config_from_dict(checkpoint.read_meta(path)["config"])
    s = ShardSet(shards)
    torch.manual_seed(0)
    model = SeqRec(s.num_items, cfg.model)
    model.load_state_dict(checkpoint.load(path)["model"])
    model = model.to(device)
    data = EvalData(s.eval_path, s.num_items, cfg.model.max_len, cfg.eval)
    from training.ranking import make_ranker

    out: dict[str, Any] = {
        "ranker": type(make_ranker(model, s.num_items, cfg.eval.item_chunk, "bf16", device)).__name__
    }
    for precision in ("fp32", "bf16"):
        t = time.monotonic()
        m = evaluate(model, data, dataclasses.replace(cfg.eval, precision=precision), splits=("test",))
        out[precision] = {"metrics": {k: v for k, v in m.items() if "/full/" in k}, "s": time.monotonic() - t}
    return out


def part_table(work: Path, sz: dict, gpus: int, budget: float) -> dict:
    from dataprep.build import build_shards
    from dataprep.settings import ShardSettings
    from dataprep.synth import write_synthetic

    ranks = 2 if (gpus >= 2 or not gpus) else 1  # NCCL puts no two ranks of one group on one GPU
    events, shards = work / "dev-events.txt", work / "dev-shards"
    write_synthetic(str(events), users=sz["ft_users"], items=400, seed=3, median_len=12, max_history=60)
    settings = ShardSettings(world_size=ranks, batch_size=16, max_len=50)
    m = build_shards(str(events), "sasrec", str(shards), settings, overwrite=True)
    sets = [
        f"train.epochs={max(1, math.ceil(sz['ft_steps'] / m['steps']))}",
        f"model.dim={sz['ft_dim']}",
        "mlflow.enabled=false",
        "eval.periodic=false",
        "eval.final=false",
        "optim.item_optimizer=rowwise_adam",
        *(["comm.embedding=sharded", f"comm.transport={'smfree' if gpus else 'collective'}"] if ranks > 1 else []),
    ]
    rc, log = _launch(work, str(shards), ranks, gpus, budget * 0.8, sets)
    (work / "dev-launch.log").write_text(log)
    res: dict[str, Any] = {"ranks": ranks, "exit": rc, "log": str(work / "dev-launch.log"), "fails": []}
    res["devices"] = sorted(
        {ln.split(" on ", 1)[1].split()[0] for ln in log.splitlines() if "[distributed]" in ln and " on cuda" in ln}
    )
    res["sharded"] = "item table sharded row-wise" in log
    result = work / "dev-run" / "replica_0" / "result.json"
    if rc != 0 or not result.exists():
        res["fails"].append(f"launcher exit {rc}: {log[-1500:]}")
        return res
    dev = torch.device("cuda", 0) if gpus else torch.device("cpu")
    res["eval"] = _eval_both(json.loads(result.read_text()), str(shards), dev)
    res["eval_equal"] = res["eval"]["fp32"]["metrics"] == res["eval"]["bf16"]["metrics"]
    if res["eval"]["ranker"] != "BoundedRanker":  # eval.precision=bf16 must rank with bf16 products
        res["fails"].append(f"eval.precision=bf16 ranked with {res['eval']['ranker']}")
    if gpus and not res["devices"]:
        res["fails"].append("no rank reported a CUDA device")
    if ranks > 1 and not res["sharded"]:
        res["fails"].append("comm.embedding=sharded did not shard the item table")
    if not res["eval_equal"]:
        res["fails"].append("bf16 full ranking gave other metrics than float32")
    return res


# ---- the claims -------------------------------------------------------------------------------


def _part(res: dict, name: str) -> dict | None:
    v = res.get(name)
    return v if isinstance(v, dict) else None


def _missing(text: str, res: dict, name: str) -> Claim:
    return Claim(text, "FAIL", "-", f"part {name}: {res.get(name, 'not run')}")


def ft_claims(res: dict, gpus: int) -> list[Claim]:
    heal, ftar = "kill -9 of a replica group, then a bitwise heal, on CUDA", "FTAR across two groups, CUDA tensors"
    ft = _part(res, "ft")
    if ft is None:
        return [_missing(heal, res, "ft"), _missing(ftar, res, "ft")]
    ok = ft.get("identical") is True and ft.get("restarts") == 1 and ft.get("healed") is True
    figure = f"killed at step {ft.get('kill_at_step')}, {ft.get('restarts')} restart, identical {ft.get('identical')}"
    devices = ",".join(ft.get("devices", [])) or "cpu"
    one = "both groups on GPU 0: FTAR stages through the host, no device-to-device bytes" if gpus == 1 else ""
    return [
        _judge(heal, ok and not ft["fails"], figure, gpus, "; ".join(ft["fails"])[:300]),
        _judge(
            ftar, ok and (not gpus or "cuda" in devices), f"{ft.get('committed_steps')} steps on {devices}", gpus, one
        ),
    ]


def table_claims(res: dict, gpus: int) -> list[Claim]:
    rowwise, sharded = "row-wise item optimizer on the device", "sharded item table on the device (K = 2)"
    bf16 = "bf16 full-ranking evaluation on CUDA: the float32 metrics, bit for bit"
    dv = _part(res, "table")
    if dv is None:
        return [_missing(t, res, "table") for t in (rowwise, sharded, bf16)]
    ran = dv["exit"] == 0 and "eval" in dv and bool(not gpus or dv.get("devices"))
    where = ",".join(dv.get("devices", [])) or "cpu"
    out = [_judge(rowwise, ran, f"{dv['ranks']} rank(s) on {where}", gpus, "; ".join(dv["fails"])[:300])]
    if dv["ranks"] < 2:
        out.append(Claim(sharded, "SKIP", "-", "one GPU: NCCL puts no two ranks of one group on one GPU"))
    else:
        out.append(_judge(sharded, ran and dv["sharded"], f"2 ranks on {where}, sharded {dv['sharded']}", gpus))
    if ran:
        ev = dv["eval"]
        fig = f"equal {dv['eval_equal']} ({ev['ranker']}); {ev['fp32']['s']:.2f} s fp32, {ev['bf16']['s']:.2f} s bf16"
        out.append(_judge(bf16, dv["eval_equal"] and ev["ranker"] == "BoundedRanker", fig, gpus))
    else:
        out.append(Claim(bf16, "FAIL", "-", "the training run failed"))
    return out


def slowdown_claims(res: dict, gpus: int) -> list[Claim]:
    texts = (
        "smfree all-to-all launches no SM kernel (CUDA profiler)",
        "smfree all-reduce launches no SM kernel (CUDA profiler)",
        "a matmul slows less beside smfree than beside NCCL (side by side)",
    )
    sd = _part(res, "slowdown")
    if sd is None:
        return [_missing(t, res, "slowdown") for t in texts]
    if not gpus:
        why = "GPU-only: no copy engines or SM kernels on CPU"
        return [Claim(t, "SKIP", "-", why) for t in texts]
    out = []
    for text, key in zip(texts, ("smfree_kernels", "smfree_allreduce_kernels"), strict=False):
        k = sd.get(key)
        out.append(Claim(text, "PASS" if k == [] else "FAIL", f"kernels: {k}"))
    rows = sd["rows"]
    sm, nc = rows.get("smfree_copy_engines"), rows.get("nccl_all_to_all")
    one = "one GPU: NCCL to itself and smfree through the host (copy engines), no bytes between devices"
    if sm is None or nc is None:
        out.append(Claim(texts[2], "FAIL", "-", f"rows: {sorted(rows)}"))
    else:
        fig = (
            f"x{sm['slowdown']:.3f} smfree ({sm['gbytes_per_s_overlapped']:.1f} GB/s) vs "
            f"x{nc['slowdown']:.3f} NCCL ({nc['gbytes_per_s_overlapped']:.1f} GB/s)"
        )
        ok = sm["slowdown"] < nc["slowdown"] and sm["covered"] and nc["covered"]
        out.append(Claim(texts[2], "PASS" if ok else "FAIL", fig, one if sd["world"] < 2 else ""))
    return out


def throughput_claims(res: dict, gpus: int) -> list[Claim]:
    tok, pad = "balanced shards: more non-padding tokens/s than random ones", "balanced shards pad less than random"
    tp = _part(res, "throughput")
    if tp is None:
        return [_missing(tok, res, "throughput"), _missing(pad, res, "throughput")]
    by = {(r["max_len"], r["attention"], r["shards"]): r for r in tp["rows"]}
    pairs = [(by[k], by[(*k[:2], "random")]) for k in by if k[2] == "balanced" and (*k[:2], "random") in by]
    if not pairs:
        return [Claim(tok, "FAIL", "-", "no row ran"), Claim(pad, "FAIL", "-", "no row ran")]
    ratios = [b["tokens_per_s"] / r["tokens_per_s"] for b, r in pairs]
    gm = math.exp(statistics.fmean(math.log(x) for x in ratios))
    fig = f"x{gm:.2f} geometric mean over {len(ratios)} rows (min x{min(ratios):.2f})"
    fewer = all(b["padding_fraction"] < r["padding_fraction"] for b, r in pairs)
    b0, r0 = pairs[0]
    pads = f"{b0['padding_fraction']:.3f} vs {r0['padding_fraction']:.3f} at max_len {b0['max_len']}"
    out = [Claim(pad, "PASS" if fewer else "FAIL", pads)]
    if gpus:
        out.insert(0, Claim(tok, "PASS" if gm > 1 else "FAIL", fig))
    else:
        out.insert(0, Claim(tok, "SKIP", fig, "timings on a shared CPU mean nothing"))
    return out


BY_PART = {"ft": ft_claims, "table": table_claims, "slowdown": slowdown_claims, "throughput": throughput_claims}


def claims(res: dict, gpus: int, parts: list[str]) -> list[dict]:
    """The claims of BENCHMARKS.md's "GPU claims" that `parts` show, judged from their results."""
    return [asdict(c) for name in parts for c in BY_PART[name](res, gpus)]


def table(rows: list[dict]) -> str:
    """The claims as a text table: status, claim, figure, note."""
    lines = [f"{'status':6}  {'claim':70}  figure / note", f"{'-' * 6}  {'-' * 70}  {'-' * 30}"]
    for c in rows:
        tail = c["figure"] + (f"  ({c['note']})" if c["note"] else "")
        lines.append(f"{c['status']:6}  {c['claim'][:70]:70}  {tail}")
    return "\n".join(lines)
