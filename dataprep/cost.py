"""Cost model of one training sample: c(L) = a*L^2 + b*L + c0 (L = history length).

The long form: docs/dataprep.md, "dataprep/cost"."""

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dataprep import files
from dataprep.errors import DataprepError


@dataclass(frozen=True)
class CostModel:
    a: float
    b: float
    c0: float
    source: str = "default"
    fit: dict = field(default_factory=dict, compare=False)  # lengths, timings, model, r2

    def __call__(self, lengths) -> np.ndarray:
        L = np.asarray(lengths, dtype=np.float64)
        return (self.a * L + self.b) * L + self.c0

    def to_dict(self) -> dict:
        return asdict(self)


# From `python -m dataprep calibrate` (stand-in model: d=64, 2 layers, batch 8 and 16, one thread,
# this 2-core CPU, torch 2.13), rounded over repeated runs: microseconds per sample. At L=50 the
# linear term dominates (~80%); at L=1024 the quadratic one is about half. Only ratios matter.
DEFAULT = CostModel(a=0.027, b=25.0, c0=200.0, source="default")


def _validate(m: CostModel, where: str) -> CostModel:
    for k in ("a", "b", "c0"):
        v = getattr(m, k)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise DataprepError(f"{where}: cost model coefficient {k}={v!r} must be a finite number >= 0")
    if m(1) <= 0:
        raise DataprepError(f"{where}: cost model gives c(1) <= 0; at least one of a, b, c0 must be > 0")
    return m


def load_cost_model(spec: "str | os.PathLike | dict | CostModel | None") -> CostModel:
    """None -> DEFAULT; a dict {a, b, c0}; or the path of a JSON file written by `calibrate`."""
    if spec is None:
        return DEFAULT
    if isinstance(spec, CostModel):
        return _validate(spec, "cost model")
    where = "cost model"
    if isinstance(spec, (str, os.PathLike)):
        where = str(spec)
        try:
            spec = json.loads(Path(spec).read_text())
        except FileNotFoundError:
            raise DataprepError(
                f"{where}: cost model file not found; run `python -m dataprep calibrate --out {where}` "
                "or omit --cost-model"
            ) from None
        except (OSError, ValueError) as e:
            raise DataprepError(
                f'{where}: not a readable JSON cost model ({e}); expected {{"a": .., "b": .., "c0": ..}}'
            ) from None
    if not isinstance(spec, dict) or not {"a", "b", "c0"} <= spec.keys():
        raise DataprepError(f"{where}: cost model needs keys a, b, c0 (c(L) = a*L^2 + b*L + c0)")
    return _validate(
        CostModel(
            a=spec["a"],
            b=spec["b"],
            c0=spec["c0"],
            source=str(spec.get("source", "file")),
            # a manifest's cost_model names the device timed beside a, b, c0 (build.prepare)
            fit=dict(spec.get("fit", {})) | ({"device": spec["device"]} if "device" in spec else {}),
        ),
        where,
    )


def fit(lengths, timings) -> tuple[float, float, float]:
    """Least squares for a*L^2 + b*L + c0 with all coefficients >= 0.

    A negative coefficient (noise on a short range) is dropped and the rest refit.
    """
    L = np.asarray(lengths, dtype=np.float64)
    y = np.asarray(timings, dtype=np.float64)
    cols = {"a": L * L, "b": L, "c0": np.ones_like(L)}
    active = list(cols)
    while active:
        X = np.stack([cols[k] for k in active], axis=1)
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        if (coef >= 0).all():
            out = dict.fromkeys(cols, 0.0)
            out.update(zip(active, map(float, coef), strict=True))
            return out["a"], out["b"], out["c0"]
        active.pop(int(np.argmin(coef)))
    return 0.0, 0.0, float(max(y.mean(), 1e-9))


def fit_batched(L, n, t) -> tuple[float, float, float, float]:
    """Weighted least squares for t = n*(a*L^2 + b*L + c0) + overhead, all terms >= 0
    (a negative one is dropped and the rest refit). Weights 1/t: relative errors count."""
    L, n, t = (np.asarray(x, dtype=np.float64) for x in (L, n, t))
    cols = {"a": n * L * L, "b": n * L, "c0": n, "overhead": np.ones_like(L)}
    w = 1.0 / np.maximum(t, 1e-12)
    active = list(cols)
    while active:
        X = np.stack([cols[k] for k in active], axis=1) * w[:, None]
        coef, *_ = np.linalg.lstsq(X, t * w, rcond=None)
        if (coef >= 0).all():
            out = dict.fromkeys(cols, 0.0)
            out.update(zip(active, map(float, coef), strict=True))
            return out["a"], out["b"], out["c0"], out["overhead"]
        active.pop(int(np.argmin(coef)))
    return 0.0, 0.0, float(max((t / n).mean(), 1e-9)), 0.0


def _r2(L, n, t, coef) -> float:
    a, b, c0, o = coef
    pred = n * ((a * L + b) * L + c0) + o
    return 1 - float(((t - pred) ** 2).sum() / max(((t - t.mean()) ** 2).sum(), 1e-12))


def _standin_step(length: int, batch: int, dim: int = 64, layers: int = 2, items: int = 10_000):
    """A forward+backward closure of a small causal self-attention model (SASRec-like)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    emb = torch.nn.Embedding(items, dim)
    blocks = torch.nn.ModuleList(
        torch.nn.ModuleDict(
            {
                "qkv": torch.nn.Linear(dim, 3 * dim),
                "out": torch.nn.Linear(dim, dim),
                "ff1": torch.nn.Linear(dim, 4 * dim),
                "ff2": torch.nn.Linear(4 * dim, dim),
                "n1": torch.nn.LayerNorm(dim),
                "n2": torch.nn.LayerNorm(dim),
            }
        )
        for _ in range(layers)
    )
    x_ids = torch.randint(1, items, (batch, length))
    heads = 2

    def step():
        x = emb(x_ids)
        for b in blocks:
            q, k, v = b["qkv"](b["n1"](x)).view(batch, length, 3, heads, dim // heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + b["out"](a.transpose(1, 2).reshape(batch, length, dim))
            x = x + b["ff2"](F.gelu(b["ff1"](b["n2"](x))))
        logits = x @ emb.weight[:512].T  # sampled-softmax-like head
        logits.logsumexp(-1).mean().backward()

    return step


MODELS = {"standin": _standin_step}  # the real model: training/calibrate.py


def _best_time(step: Callable[[], None], repeats: int) -> float:
    """The fastest of `repeats` calls, after one warm-up call."""
    step()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best


def _timings(make, lengths: list[int], batch: int, repeats: int, budget_s: float, quiet: bool) -> list[tuple]:
    """(L, n, seconds) at n = batch and 2*batch for each length, until the budget is spent."""
    from dataprep.progress import Progress

    t_start = time.monotonic()
    rows = []
    with Progress("calibrate", len(lengths), quiet=quiet) as bar:
        for L in lengths:
            for n in (batch, 2 * batch):
                rows.append((L, n, _best_time(make(L, n), repeats)))
            bar.update()
            if time.monotonic() - t_start > budget_s:
                break
    return rows


def calibrate(
    lengths=(8, 16, 32, 64, 128, 256, 512, 1024),
    *,
    batch: int = 8,
    repeats: int = 5,
    model: str = "standin",
    budget_s: float = 60.0,
    quiet: bool = True,
    step: Callable[[int, int], Callable[[], None]] | None = None,
) -> CostModel:
    """Time forward+backward per sample at each length and fit c(L). Returns the CostModel.

    `step(length, batch)` builds one timed forward+backward of the model to fit (training
    passes its own, training/calibrate.py); without it, the named built-in stand-in."""
    import torch

    if step is None and model not in MODELS:
        raise DataprepError(
            f"--model {model!r}: unknown; choose one of {sorted(MODELS)} (the training model: `ftrec calibrate`)"
        )
    torch.set_num_threads(1)  # the machine is shared; one thread gives stable, comparable timings
    make = step or MODELS[model]
    lengths = sorted(int(x) for x in lengths)
    if not lengths or lengths[0] < 1 or len(lengths) < 3:
        raise DataprepError("--lengths: give at least three lengths >= 1")
    # time(L, n) = per-call overhead + n * c(L), measured at n = batch and 2*batch and fitted
    # jointly, so that the per-step overhead every rank pays once (which balancing cannot change)
    # does not inflate c0; relative weights keep short lengths from being drowned by long ones
    rows = _timings(make, lengths, batch, repeats, budget_s, quiet)
    used = sorted({r[0] for r in rows})
    if len(used) < 3:
        raise DataprepError(
            f"calibration ran out of its {budget_s:.0f}s budget after {len(used)} lengths; "
            "raise --budget or use shorter --lengths"
        )
    Ls, ns, ts = (np.asarray(c, dtype=np.float64) for c in zip(*rows, strict=True))
    a, b, c0, overhead = fit_batched(Ls, ns, ts * 1e6)
    per_sample = [(a * L + b) * L + c0 for L in used]
    r2 = _r2(Ls, ns, ts * 1e6, (a, b, c0, overhead))
    if c0 == 0 and a == 0 and b == 0:
        c0 = 1.0
    return CostModel(
        a=a,
        b=b,
        c0=c0,
        source=f"calibrated:{model}",
        fit={
            "lengths": used,
            "us_per_sample": [round(v, 3) for v in per_sample],
            "batch": batch,
            "per_call_overhead_us": round(overhead, 3),
            "r2": round(r2, 5),
            "model": model,
            "timings": [[int(L), int(n), round(t * 1e6, 3)] for L, n, t in rows],
            "torch_threads": 1,
        },
    )


def save(m: CostModel, path: str) -> None:
    files.write_text(path, json.dumps(m.to_dict(), indent=2) + "\n")
