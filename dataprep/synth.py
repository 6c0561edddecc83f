"""Synthetic interaction logs with the shape of real ones, at any size.

Zipf item popularity, lognormal (heavy-tailed) history lengths clipped to [min_len,
max_history], optionally a Markov successor (`markov`) so there is a sequence to learn.
Deterministic by seed and streamed in fixed chunks of users, so memory stays bounded.
Formats: sasrec, iclrec, events (Parquet), events-csv. Details: docs/dataprep.md.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from dataprep.errors import DataprepError
from dataprep.files import staged
from dataprep.progress import Progress

SYNTH_FORMATS = ("sasrec", "iclrec", "events", "events-csv")
CHUNK_USERS = 50_000
T0 = 1_600_000_000  # epoch seconds of the first event


@dataclass(frozen=True)
class SynthConfig:
    users: int
    items: int
    seed: int = 0
    median_len: float = 20.0  # median history length (events per user)
    sigma: float = 1.2  # lognormal shape: larger = heavier tail
    min_len: int = 5  # 5-core-like floor
    max_history: int = 4096  # cap of the tail
    zipf: float = 1.1  # popularity exponent s
    markov: float = 0.0  # probability that an event is its predecessor's successor item


def lengths(cfg: SynthConfig, rng: np.random.Generator, n: int) -> np.ndarray:
    raw = rng.lognormal(np.log(cfg.median_len), cfg.sigma, n)
    return np.clip(np.round(raw), cfg.min_len, cfg.max_history).astype(np.int64)


def _chunks(cfg: SynthConfig):
    """Yields (user ids, offsets, item ids, timestamps) per chunk of users."""
    ranks = np.arange(1, cfg.items + 1, dtype=np.float64)
    cdf = np.cumsum(ranks**-cfg.zipf)
    cdf /= cdf[-1]
    item_of_rank = np.random.default_rng([cfg.seed, 0x17E5]).permutation(cfg.items).astype(np.int64) + 1
    successor = np.random.default_rng([cfg.seed, 0x5EC]).permutation(cfg.items).astype(np.int64) + 1
    for c, u0 in enumerate(range(0, cfg.users, CHUNK_USERS)):
        rng = np.random.default_rng([cfg.seed, c])
        nu = min(CHUNK_USERS, cfg.users - u0)
        ln = lengths(cfg, rng, nu)
        off = np.zeros(nu + 1, np.int64)
        np.cumsum(ln, out=off[1:])
        items = item_of_rank[np.minimum(np.searchsorted(cdf, rng.random(off[-1])), cfg.items - 1)]
        if cfg.markov > 0:
            follow = rng.random(off[-1]) < cfg.markov
            follow[off[:-1]] = False  # a user's first event follows nothing
            for k in np.flatnonzero(follow):  # in order: chains of followers
                items[k] = successor[items[k - 1] - 1]
        start = T0 + rng.integers(0, 365 * 86400, nu)
        gaps = 1 + rng.exponential(3600.0, off[-1]).astype(np.int64)  # >= 1 s: no ties inside a user
        gaps[off[:-1]] = 0
        ts = np.repeat(start, ln) + _segment_cumsum(gaps, off)
        yield np.arange(u0 + 1, u0 + nu + 1, dtype=np.int64), off, items, ts


def _segment_cumsum(x: np.ndarray, off: np.ndarray) -> np.ndarray:
    c = np.cumsum(x)
    base = np.repeat(c[off[:-1]] - x[off[:-1]], np.diff(off))
    return c - base


def write_synthetic(
    path: str,
    *,
    users: int,
    items: int,
    seed: int = 0,
    fmt: str = "sasrec",
    median_len: float = 20.0,
    sigma: float = 1.2,
    min_len: int = 5,
    max_history: int = 4096,
    zipf: float = 1.1,
    markov: float = 0.0,
    quiet: bool = True,
) -> str:
    """Write a synthetic interaction log to `path` (atomically) and return the path."""
    if fmt not in SYNTH_FORMATS:
        raise DataprepError(f"--format {fmt!r}: synth writes one of {', '.join(SYNTH_FORMATS)}")
    if users < 1 or items < 2:
        raise DataprepError("--users must be >= 1 and --items >= 2")
    if not (1 <= min_len <= max_history) or median_len <= 0 or sigma < 0 or zipf <= 0 or not 0 <= markov < 1:
        raise DataprepError(
            "need 1 <= --min-len <= --max-history, --median-len > 0, --sigma >= 0, --zipf > 0, 0 <= markov < 1"
        )
    cfg = SynthConfig(users, items, seed, median_len, sigma, min_len, max_history, zipf, markov)
    out = Path(path)
    writer = None
    with staged(out) as tmp, open(tmp, "wb") as f, Progress("synth", users, quiet=quiet, unit=" users") as bar:
        for uid, off, it, ts in _chunks(cfg):
            ln = np.diff(off)
            if fmt == "sasrec":
                t = pa.table({"u": np.repeat(uid, ln), "i": it})
                pcsv.write_csv(t, f, pcsv.WriteOptions(include_header=False, delimiter=" ", quoting_style="none"))
            elif fmt == "iclrec":
                lists = pa.ListArray.from_arrays(pa.array(off.astype(np.int32)), pc.cast(pa.array(it), pa.string()))
                line = pc.binary_join_element_wise(pc.cast(pa.array(uid), pa.string()), pc.binary_join(lists, " "), " ")
                pcsv.write_csv(pa.table({"l": line}), f, pcsv.WriteOptions(include_header=False, quoting_style="none"))
            else:
                order = np.argsort(ts, kind="stable")  # a log: events in time order within the chunk
                t = pa.table({"user_id": np.repeat(uid, ln)[order], "item_id": it[order], "timestamp": ts[order]})
                if fmt == "events":
                    if writer is None:
                        writer = pq.ParquetWriter(f, t.schema)
                    writer.write_table(t)
                else:
                    pcsv.write_csv(t, f, pcsv.WriteOptions(include_header=writer is None))
                    writer = writer or True
            bar.update(len(uid))
        if writer not in (None, True):
            writer.close()
    return str(out)
