"""The global temporal split (`--split temporal`): what production judges a model by.

Every event at or before a cut time T trains; each user's first event after T, up to T +
horizon, is its test target, ranked against the catalogue with the user's history excluded.
The last event at or before T of a tested user is its validation target (early stopping and
model selection never see the window after T). So no event after T trains, every test user has
history before T, and users with nothing in the window only train. T defaults to the time
before which 90% of the events fall; the horizon to the last event. Both come from the input's
own timestamps (formats that carry them: events, movielens) and go into the manifest's "split".
"""

import math
from collections.abc import Callable, Iterable
from dataclasses import replace

import numpy as np

from dataprep.errors import DataprepError
from dataprep.sequences import Holdout, Sequences, leave_one_out

CUT_QUANTILE = 0.9  # the default cut: this share of the events is at or before it
COUNTS = ("test_users", "train_events", "users_without_history", "events_after_cut")  # the split's, summed


def settings(split: str, cut: int | None, horizon: int | None, fmt: str, time_formats: tuple) -> dict:
    """The shard set's config entries of the split (none for leave-one-out, so its sets stay as
    they were) of settings a ShardSettings checked; DataprepError when a temporal split's
    format `fmt` has no times."""
    if split == "leave_one_out":
        return {}
    if fmt not in time_formats:
        raise DataprepError(
            f"--split temporal needs event times: --format {fmt} has none; use one of {', '.join(time_formats)}"
        )
    return {"split": "temporal", "cut": cut, "horizon": horizon}


def holdout(seq: Sequences, config: dict) -> Holdout:
    """The config's split of `seq`: leave-one-out, or temporal at config's cut and horizon."""
    if config.get("split") != "temporal":
        return leave_one_out(seq)
    return temporal(seq, config.get("cut"), config.get("horizon"))


def temporal(seq: Sequences, cut: int | None = None, horizon: int | None = None) -> Holdout:
    """The split at `cut` (epoch seconds; None: CUT_QUANTILE of the event times), testing events
    up to cut + `horizon` seconds (None: the last event). Timestamps ascend within each user."""
    ts = seq.timestamps
    if ts is None or len(ts) == 0:
        raise DataprepError("--split temporal needs event times; this input has none")
    t, end = window(lambda: [ts], cut, horizon)
    hold = holdout_at(seq.offsets, ts, t, end)
    return replace(hold, info=split_info(t, end, cut, [hold.info]))


def window(chunks: Callable[[], Iterable[np.ndarray]], cut: int | None, horizon: int | None) -> tuple[int, int]:
    """(T, end): the cut (`cut`, else the CUT_QUANTILE quantile of the event times by numpy's
    "lower" method) and the end of the test window (T + `horizon`, else the last event time).
    The times (epoch seconds) come in chunks, `chunks()` giving them again on each call: the
    in-memory build's one array, or the bucketed build's buckets, read in a few passes, each
    holding one chunk; both builds take the same cut from the same events."""
    n, lo, hi = 0, 0, 0
    for c in chunks():
        if len(c):
            a, b = int(c.min()), int(c.max())
            lo, hi = (a, b) if n == 0 else (min(lo, a), max(hi, b))
            n += len(c)
    if n == 0:
        raise DataprepError("--split temporal needs event times; this input has none")
    t = int(cut) if cut is not None else _kth(chunks, math.floor((n - 1) * CUT_QUANTILE), lo, hi)
    return t, hi if horizon is None else t + int(horizon)


BINS = 1 << 16  # the value range is cut into this many bins a pass (_kth)


def _kth(chunks: Callable[[], Iterable[np.ndarray]], k: int, lo: int, hi: int) -> int:
    """The k-th smallest (0-based) of the chunks' values, all within [lo, hi]: each pass counts
    them in BINS bins of the range and keeps the bin that holds the k-th (epoch seconds: 3
    passes at most)."""
    while lo < hi:
        width = (hi - lo) // BINS + 1
        counts = np.zeros(BINS, np.int64)
        for c in chunks():
            c = c[(c >= lo) & (c <= hi)]
            counts += np.bincount((c - lo) // width, minlength=BINS)
        below = np.cumsum(counts)
        b = int(np.searchsorted(below, k, side="right"))  # the bin holding the k-th
        k -= int(below[b - 1]) if b else 0
        lo, hi = lo + b * width, min(hi, lo + (b + 1) * width - 1)
    return lo


def holdout_at(offsets: np.ndarray, ts: np.ndarray, t: int, end: int) -> Holdout:
    """The split of users (`offsets` into their event times `ts`, ascending within each user) at
    the cut `t`, testing events up to `end`: a user's own events decide it, so the bucketed build
    splits bucket by bucket. Its info holds the counts split_info sums."""
    n = np.diff(offsets)
    num_users = len(n)
    owner = np.repeat(np.arange(num_users), n)
    before = np.bincount(owner[ts <= t], minlength=num_users)  # events at or before the cut
    nxt = offsets[:-1] + before  # each user's first event after the cut, where it has one
    tested = (before < n) & (before >= 2)  # a validation event and some history before it
    tested[tested] = ts[nxt[tested]] <= end
    users = np.flatnonzero(tested)
    train_len = np.where(tested, before - 1, before)  # a tested user's last event validates
    info = {
        "test_users": int(len(users)),
        "train_events": int(train_len.sum()),
        "users_without_history": int((before == 0).sum()),  # first seen after the cut: not used
        "events_after_cut": int(len(ts) - before.sum()),
    }
    return Holdout(train_len=train_len, users=users, test_at=before[users], info=info)


def split_info(t: int, end: int, cut: int | None, parts: list[dict]) -> dict:
    """The manifest's "split" of the cut `t` and window end `end` (`cut`: as given), the counts
    summed over `parts` (holdout_at's infos); DataprepError when no user is tested."""
    info = {
        "kind": "temporal",
        "cut": t,
        "horizon": end - t,
        "cut_from": "--cut" if cut is not None else f"quantile {CUT_QUANTILE} of the event times",
    }
    info |= {k: sum(p[k] for p in parts) for k in COUNTS}
    if info["test_users"] == 0:
        raise DataprepError(
            f"--split temporal: no user has 2 events at or before the cut {t} and one after it within "
            f"{end - t} s; move --cut or widen --horizon"
        )
    return info
