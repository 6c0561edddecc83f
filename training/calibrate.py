"""The cost model of the model being trained: FreeScale balances shards by c(L) = a*L^2 +
b*L + c0, and the right coefficients are those of this model on this machine.

`cached(model_cfg, max_len, cache_dir)` times the configured SeqRec up to max_len, once per
model config and machine, and returns the JSON file dataprep's `--cost-model` reads.

    ftrec calibrate --max-len 50 [--set model.dim=32 ...] --out cost.json
"""

import argparse
import dataclasses
import hashlib
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

from training.config import ModelConfig

NUM_ITEMS = 10_000  # the item table's size barely moves c(L): lookups, not a full softmax
NEGATIVES = 256


def lengths_up_to(max_len: int) -> list[int]:
    """Lengths to time: doubling up to max_len, and max_len itself (at least three)."""
    out, L = [], 2
    while L < max_len:
        out.append(L)
        L *= 2
    out.append(max_len)
    return sorted(set(out))[-8:] if len(out) >= 3 else [1, 2, 3]


def probe(cfg: ModelConfig) -> Callable[[int, int], Callable[[], None]]:
    """probe(cfg)(length, batch): one forward+backward of the configured model."""
    import torch

    from training.model import SeqRec

    def make(length: int, batch: int) -> Callable[[], None]:
        torch.manual_seed(0)
        model = SeqRec(NUM_ITEMS, dataclasses.replace(cfg, max_len=max(cfg.max_len, length)))
        values = torch.randint(1, NUM_ITEMS + 1, (batch * length,))
        offsets = torch.arange(0, batch * length + 1, length)
        negatives = torch.randint(1, NUM_ITEMS + 1, (NEGATIVES,))

        def step() -> None:
            h = model(values, offsets)
            model.scores(h, negatives).logsumexp(-1).mean().backward()

        return step

    return make


def machine() -> dict:
    """What makes timings of one machine comparable with another's."""
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "arch": platform.machine(), "torch": torch.__version__}


def fit(cfg: ModelConfig, max_len: int, budget_s: float):
    """Time `cfg`'s model at lengths up to max_len and fit c(L) (dataprep.cost.CostModel)."""
    from dataprep.cost import calibrate

    return calibrate(lengths_up_to(max_len), batch=8, repeats=3, model="training", budget_s=budget_s, step=probe(cfg))


def cached(cfg: ModelConfig, max_len: int, cache_dir: str | os.PathLike, budget_s: float = 60.0) -> str:
    """The cost model file for `cfg` at lengths up to `max_len` on this machine, calibrated
    the first time (atomically written: concurrent tasks at worst both calibrate)."""
    from dataprep.cost import save

    key_doc = {"model": dataclasses.asdict(cfg), "max_len": max_len, "machine": machine()}
    key = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"cost-{key}.json"
    if not path.exists():
        m = fit(cfg, max_len, budget_s)
        m = dataclasses.replace(m, fit={**m.fit, "key": key_doc})
        path.parent.mkdir(parents=True, exist_ok=True)
        save(m, str(path))
    return str(path)


def model_config(overrides: list[str]) -> ModelConfig:
    """The ModelConfig that `model.KEY=VALUE` overrides (the trainer's syntax) give."""
    from training.config import load_config

    return load_config(None, [o for o in overrides if o.startswith("model.")]).model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ftrec calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--max-len", type=int, default=50, help="the shard set's max_len (dataprep --max-len)")
    p.add_argument("--set", action="append", default=[], metavar="model.KEY=VALUE", help="a model setting")
    p.add_argument("--out", required=True, help="JSON file to write (dataprep --cost-model reads it)")
    p.add_argument("--budget", type=float, default=120.0)
    a = p.parse_args(argv)
    from dataprep.cost import save

    m = fit(model_config(a.set), a.max_len, a.budget)
    save(m, a.out)
    print(f"wrote {a.out}: c(L) = {m.a:.4g}*L^2 + {m.b:.4g}*L + {m.c0:.4g} us (r2 {m.fit['r2']})")
    return 0
