"""The cost model of the model being trained: FreeScale balances shards by c(L) = a*L^2 +
b*L + c0, and the right coefficients are those of this model on the device it trains on.

`cached(model_cfg, max_len, cache_dir)` times the configured SeqRec on the training device (the
trainer's own choice: rank_device), once per device name, model config and torch version, and
returns the JSON file dataprep's `--cost-model` reads; its fit names the device it timed, and the
shard manifest carries that name. A noisy fit (`noise()`: r^2 under R2_MIN, timings that fall as
L grows, or no growth at all) is measured again, and never cached.

    ftrec calibrate --max-len 50 [--set model.dim=32 ...] --out cost.json
    ftrec calibrate --max-len 50 --cache-dir WORK/cost-models --pool gpu   # on the training pool
"""

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

from training.config import ModelConfig

NUM_ITEMS = 10_000  # the item table's size barely moves c(L): lookups, not a full softmax
NEGATIVES = 256
R2_MIN = 0.9  # a fit explaining less of the timings is noise, not a cost model
DIP = 0.15  # a timing may fall this much (relative) below a shorter length's before it is noise
FLAT = 0.05  # a batch's c(max L) - c(min L) under this share of the fastest timing: a constant fit
ATTEMPTS = 3  # measurements of a noisy fit before the best one is used (uncached)
log = logging.getLogger(__name__)


def lengths_up_to(max_len: int) -> list[int]:
    """Lengths to time: doubling up to max_len, and max_len itself (at least three)."""
    out, L = [], 2
    while L < max_len:
        out.append(L)
        L *= 2
    out.append(max_len)
    return sorted(set(out))[-8:] if len(out) >= 3 else [1, 2, 3]


def probe(cfg: ModelConfig, device: str = "cpu") -> Callable[[int, int], Callable[[], None]]:
    """probe(cfg, device)(length, batch): one forward+backward of the configured model on
    `device`, finished when it returns (CUDA: synchronized)."""
    import torch

    from training.model import SeqRec

    dev = torch.device(device)

    def make(length: int, batch: int) -> Callable[[], None]:
        torch.manual_seed(0)
        model = SeqRec(NUM_ITEMS, dataclasses.replace(cfg, max_len=max(cfg.max_len, length))).to(dev)
        values = torch.randint(1, NUM_ITEMS + 1, (batch * length,), device=dev)
        offsets = torch.arange(0, batch * length + 1, length, device=dev)
        negatives = torch.randint(1, NUM_ITEMS + 1, (NEGATIVES,), device=dev)

        def step() -> None:
            h = model(values, offsets)
            model.scores(h, negatives).logsumexp(-1).mean().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        return step

    return make


def training_device() -> str:
    """The device the trainer of this process's host would use: its rank_device rule."""
    from training.distributed import rank_device

    return str(rank_device())


def device_name(device: str) -> str:
    """What makes timings on `device` comparable with another's: the GPU's name, or the CPU's
    model and core count."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"cpu: {cpu} x{os.cpu_count()} ({platform.machine()})"


def noise(fit: dict) -> str | None:
    """Why a fit (dataprep.cost.calibrate's `fit` dict, with its coefficients) is not a cost
    model, or None: a constant c(L) (every length would cost the same), r^2 under R2_MIN, or a
    timing that falls by more than DIP as L grows at a fixed batch."""
    lo, hi = min(r[0] for r in fit["timings"]), max(r[0] for r in fit["timings"])
    n, t = min(r[1] for r in fit["timings"]), min(r[2] for r in fit["timings"])
    c = lambda L: (fit["a"] * L + fit["b"]) * L + fit["c0"]  # noqa: E731
    if n * (c(hi) - c(lo)) <= FLAT * t:  # the fitted growth is not visible in the timings
        return f"constant fit (c({hi}) - c({lo}) = {c(hi) - c(lo):.3g} us a sample): the timings do not grow with L"
    if fit["r2"] < R2_MIN:
        return f"r^2 {fit['r2']:.3f} < {R2_MIN}"
    by_batch: dict[int, list[tuple[int, float]]] = {}
    for L, n, us in fit["timings"]:
        by_batch.setdefault(n, []).append((L, us))
    for n, rows in by_batch.items():
        rows.sort()
        for (l0, t0), (l1, t1) in zip(rows, rows[1:], strict=False):
            if t1 < (1 - DIP) * t0:
                return f"non-monotone timings at batch {n}: {t0:.0f} us at L={l0}, {t1:.0f} us at L={l1}"
    return None


def fit(cfg: ModelConfig, max_len: int, budget_s: float, device: str = "cpu", name: str | None = None):
    """Time `cfg`'s model on `device` at lengths up to max_len and fit c(L), measuring again
    (ATTEMPTS in all) while the fit is noisy; returns the CostModel (dataprep.cost), whose fit
    names the device timed and, if every attempt was noisy, why (`noisy`)."""
    from dataprep.cost import calibrate

    best = None
    for attempt in range(1, ATTEMPTS + 1):
        m = calibrate(
            lengths_up_to(max_len), batch=16, repeats=5, model="training", budget_s=budget_s, step=probe(cfg, device)
        )
        why = noise({**m.fit, "a": m.a, "b": m.b, "c0": m.c0})
        m = dataclasses.replace(m, fit={**m.fit, "device": name or device_name(device), "attempts": attempt})
        if why is None:
            return m
        log.warning("calibration on %s, attempt %d/%d: %s; measuring again", device, attempt, ATTEMPTS, why)
        if best is None or m.fit["r2"] > best.fit["r2"]:
            best = dataclasses.replace(m, fit={**m.fit, "noisy": why})
    assert best is not None
    return dataclasses.replace(best, fit={**best.fit, "attempts": ATTEMPTS})


def _key(cfg: ModelConfig, max_len: int, name: str) -> dict:
    import torch

    return {"model": dataclasses.asdict(cfg), "max_len": max_len, "device": name, "torch": torch.__version__}


def cached(
    cfg: ModelConfig,
    max_len: int,
    cache_dir: str | os.PathLike,
    budget_s: float = 60.0,
    device: str | None = None,
    name: str | None = None,
) -> str:
    """The cost model file for `cfg` at lengths up to `max_len`, timed on `device` (default: the
    training device, training_device()) and cached by its name (`name`, default device_name()),
    the model config and the torch version; calibrated the first time (written atomically:
    concurrent tasks at worst both calibrate). A noisy fit is used by this caller, not cached."""
    from dataprep.cost import save

    device = device or training_device()
    name = name or device_name(device)
    key_doc = _key(cfg, max_len, name)
    key = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"cost-{key}.json"
    if path.exists():
        return str(path)
    m = fit(cfg, max_len, budget_s, device, name)
    m = dataclasses.replace(m, fit={**m.fit, "key": key_doc})
    if "noisy" in m.fit:
        path = Path(cache_dir) / "noisy" / f"cost-{key}-{os.getpid()}.json"  # this build's, never found again
    path.parent.mkdir(parents=True, exist_ok=True)
    save(m, str(path))
    return str(path)


def pool_pointer(cache_dir: str | os.PathLike, cfg: ModelConfig, max_len: int, pool: str) -> Path:
    """Where the calibration a training pool ran (`calibrate --pool`) is named, for a shard build
    elsewhere (the Airflow worker) that cannot time that pool's device itself."""
    doc = {"model": dataclasses.asdict(cfg), "max_len": max_len, "pool": pool}
    key = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"pool-{pool}-{key}.json"


def from_pool(cache_dir: str | os.PathLike, cfg: ModelConfig, max_len: int, pool: str) -> str:
    """The cost model file the training pool `pool` calibrated for `cfg` (its pointer's path).

    Raises FileNotFoundError, naming the pointer, when the pool's calibrate step has not run."""
    pointer = pool_pointer(cache_dir, cfg, max_len, pool)
    if not pointer.exists():
        raise FileNotFoundError(
            f"{pointer}: no calibration from the training pool {pool!r} for this model config and max_len; "
            "its calibrate task (`python -m training calibrate --pool ...`) must run first"
        )
    return json.loads(pointer.read_text())["path"]


def model_config(overrides: list[str]) -> ModelConfig:
    """The ModelConfig that `model.KEY=VALUE` overrides (the trainer's syntax) give."""
    from training.config import load_config

    return load_config(None, [o for o in overrides if o.startswith("model.")]).model


def main(argv: list[str] | None = None) -> int:
    from dataprep.cost import load_cost_model, save
    from ftcore.util.files import atomic_write_text

    p = argparse.ArgumentParser(prog="ftrec calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--max-len", type=int, default=50, help="the shard set's max_len (dataprep --max-len)")
    p.add_argument("--set", action="append", default=[], metavar="model.KEY=VALUE", help="a model setting")
    p.add_argument("--out", help="JSON file to write (dataprep --cost-model reads it)")
    p.add_argument("--cache-dir", help="instead of --out: the cache (cached()), the file it holds printed")
    p.add_argument("--pool", help="with --cache-dir: name the file for shard builds of this training pool")
    p.add_argument("--device", default=None, help="the device to time (default: the trainer's, rank_device)")
    p.add_argument("--budget", type=float, default=120.0)
    a = p.parse_args(argv)
    if bool(a.out) == bool(a.cache_dir) or (a.pool and not a.cache_dir):
        p.error("give --out FILE, or --cache-dir DIR (with --pool NAME to publish it to a training pool)")
    cfg, device = model_config(a.set), a.device or training_device()
    if a.out:
        m = fit(cfg, a.max_len, a.budget, device)
        save(m, a.out)
        path = a.out
    else:
        path = cached(cfg, a.max_len, a.cache_dir, a.budget, device)
        m = load_cost_model(path)
        if a.pool:
            atomic_write_text(str(pool_pointer(a.cache_dir, cfg, a.max_len, a.pool)), json.dumps({"path": path}))
    noisy = f"; NOISY: {m.fit['noisy']}" if "noisy" in m.fit else ""
    print(
        f"wrote {path}: c(L) = {m.a:.4g}*L^2 + {m.b:.4g}*L + {m.c0:.4g} us on {m.fit['device']} "
        f"(r2 {m.fit['r2']}){noisy}"
    )
    return 0
