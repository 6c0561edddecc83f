"""The global temporal split (`--split temporal`): what production judges a model by.

Every event at or before a cut time T trains; each user's first event after T, up to T +
horizon, is its test target, ranked against the catalogue with the user's history excluded.
The last event at or before T of a tested user is its validation target (early stopping and
model selection never see the window after T). So no event after T trains, every test user has
history before T, and users with nothing in the window only train. T defaults to the time
before which 90% of the events fall; the horizon to the last event. Both come from the input's
own timestamps (formats that carry them: events, movielens) and go into the manifest's "split".
"""

import numpy as np

from dataprep.errors import DataprepError
from dataprep.sequences import Holdout, Sequences, leave_one_out

SPLITS = ("leave_one_out", "temporal")
CUT_QUANTILE = 0.9  # the default cut: this share of the events is at or before it


def settings(split: str, cut: int | None, horizon: int | None, fmt: str, time_formats: tuple) -> dict:
    """The shard set's config entries of the split (none for leave-one-out, so its sets stay as
    they were); DataprepError names the flag a user got wrong."""
    if split not in SPLITS:
        raise DataprepError(f"--split {split!r}: unknown; choose one of {', '.join(SPLITS)}")
    if split == "leave_one_out":
        if cut is not None or horizon is not None:
            raise DataprepError("--cut and --horizon belong to --split temporal")
        return {}
    if fmt not in time_formats:
        raise DataprepError(
            f"--split temporal needs event times: --format {fmt} has none; use one of {', '.join(time_formats)}"
        )
    if horizon is not None and horizon < 1:
        raise DataprepError(f"--horizon {horizon}: must be >= 1 second")
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
    t = int(np.quantile(ts, CUT_QUANTILE, method="lower")) if cut is None else int(cut)
    end = int(ts.max()) if horizon is None else t + int(horizon)
    n = np.diff(seq.offsets)
    owner = np.repeat(np.arange(seq.num_users), n)
    before = np.bincount(owner[ts <= t], minlength=seq.num_users)  # events at or before the cut
    nxt = seq.offsets[:-1] + before  # each user's first event after the cut, where it has one
    tested = (before < n) & (before >= 2)  # a validation event and some history before it
    tested[tested] = ts[nxt[tested]] <= end
    users = np.flatnonzero(tested)
    train_len = np.where(tested, before - 1, before)  # a tested user's last event validates
    info = {
        "kind": "temporal",
        "cut": t,
        "horizon": end - t,
        "cut_from": "--cut" if cut is not None else f"quantile {CUT_QUANTILE} of the event times",
        "test_users": int(len(users)),
        "train_events": int(train_len.sum()),
        "users_without_history": int((before == 0).sum()),  # first seen after the cut: not used
        "events_after_cut": int(len(ts) - before.sum()),
    }
    if len(users) == 0:
        raise DataprepError(
            f"--split temporal: no user has 2 events at or before the cut {t} and one after it within "
            f"{end - t} s; move --cut or widen --horizon"
        )
    return Holdout(train_len=train_len, users=users, test_at=before[users], info=info)
