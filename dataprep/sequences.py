"""Sequences: events -> per-user item sequences (dense ids) -> leave-one-out samples.

Group by user, order by time (stable), drop duplicates, reject users too short for
leave-one-out, remap to dense ids in sorted raw-id order (1-based, 0 is padding), then split:
train = all but the last two items, validation target = second-to-last, test = last.
Array arithmetic only, no per-user Python loop; the contract in full: docs/dataprep.md.
"""

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dataprep.errors import DataprepError
from dataprep.readers import Interactions
from dataprep.schema import MAP_SCHEMA, eval_schema
from dataprep.settings import check_choice

MIN_EVENTS = 3  # leave-one-out needs a history, a validation and a test item


@dataclass
class Sequences:
    offsets: np.ndarray  # int64 [U+1]; user u (1-based) owns values[offsets[u-1]:offsets[u]]
    values: np.ndarray  # int32 dense item ids, oldest first
    user_raw: pa.Array  # raw id of dense user u at index u-1
    item_raw: pa.Array  # raw id of dense item i at index i-1
    rejects: list[pa.Table] = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    timestamps: np.ndarray | None = None  # int64 epoch seconds of each value; None: the input has no times
    time_unit: str = ""  # the unit the input's times were in (see `seconds`)
    duplicate_events: np.ndarray | None = None  # event indices of the duplicates rejected, ascending

    @property
    def num_users(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_items(self) -> int:
        return len(self.item_raw)

    def user_map(self) -> pa.Table:
        return _map_table(self.user_raw)

    def item_map(self) -> pa.Table:
        return _map_table(self.item_raw)


@dataclass
class Samples:
    """One training sample per user with >= 4 events (train part of length >= 2)."""

    user_id: np.ndarray  # int64 dense user ids
    length: np.ndarray  # int32 len(items) = min(train length - 1, max_len)
    items: pa.ListArray  # list<int32> input history
    target: np.ndarray  # int32 item after the history
    truncated: int  # samples whose train part was longer than max_len + 1
    items_truncated: int  # items cut off by truncation
    timestamps: pa.ListArray | None = None  # list<int64> epoch seconds of each input item, or None


@dataclass(frozen=True)
class Holdout:
    """Which events of each user train, and which users are evaluated on which events: user u's
    first train_len[u] events train; eval user users[k] is tested on its event test_at[k],
    validated on the one before it, and its history is every event before that."""

    train_len: np.ndarray  # [U] per user, in dense order
    users: np.ndarray  # [E] 0-based dense users of the eval table, ascending
    test_at: np.ndarray  # [E] index of each eval user's test event in its sequence
    info: dict = field(default_factory=dict)  # the manifest's "split" (empty: leave-one-out)


def leave_one_out(seq: "Sequences") -> Holdout:
    """Every user: the last event tests, the second-to-last validates, the rest trains."""
    n = np.diff(seq.offsets)
    return Holdout(train_len=n - 2, users=np.arange(seq.num_users), test_at=n - 1)


def _map_table(raw: pa.Array) -> pa.Table:
    return pa.table(
        {"id": pa.array(np.arange(1, len(raw) + 1, dtype=np.int64)), "raw_id": raw.cast(pa.string())}, schema=MAP_SCHEMA
    )


def _codes(values: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """Dense codes 0..n-1 in sorted raw-id order, and the sorted unique raw ids."""
    uniq = pc.unique(values)
    uniq = pc.take(uniq, pc.sort_indices(uniq))
    return pc.index_in(values, value_set=uniq).to_numpy().astype(np.int64), uniq


def _order(user: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Indices sorting by (user, ts), stable. Where each user's events come in time order (a
    log usually does) and the users fit 16 bits (a bucket's do), a stable sort by user alone:
    numpy sorts 16-bit keys by radix, several times faster than the (user, ts) key's sort.
    Else one int64 key when it fits, else lexsort."""
    if len(ts) == 0:
        return np.zeros(0, np.int64)
    nu = int(user.max()) + 1
    if nu <= 1 << 16 and _in_time_order(user[:4096], ts[:4096]):  # the first events first: a cheap no
        order = np.argsort(user.astype(np.uint16), kind="stable")
        if _in_time_order(user, ts, order):
            return order
    t0, t1 = int(ts.min()), int(ts.max())
    span = t1 - t0 + 1
    if span * nu < (1 << 62):
        return stable_argsort(user * span + (ts - t0))
    return np.lexsort((ts, user))


def _in_time_order(user: np.ndarray, ts: np.ndarray, order: "np.ndarray | None" = None) -> bool:
    """Whether each user's events come in time order (`order`: the events grouped by user, stably)."""
    if order is None:
        order = np.argsort(user, kind="stable")
    u, t = user[order], ts[order]
    return not np.any((t[1:] < t[:-1]) & (u[1:] == u[:-1]))


def stable_argsort(key: np.ndarray) -> np.ndarray:
    """np.argsort(key, kind="stable") of int64 keys. Where a key and its index fit in 63 bits
    together, one sort of the values (key << bits | index): numpy sorts values with SIMD, about
    twice as fast as an argsort here, and ties come out in index order by construction. Else
    the faster unstable argsort, each run of equal keys then put back in index order (ties are
    few: duplicates and same-time events)."""
    bits = max(len(key) - 1, 1).bit_length()
    if len(key) and 0 <= int(key.min()) and int(key.max()) < 1 << (63 - bits):
        return np.sort((key << bits) | np.arange(len(key))) & ((1 << bits) - 1)
    order = np.argsort(key)
    k = key[order]
    tie = np.flatnonzero(k[1:] == k[:-1])
    if len(tie):
        pos = np.union1d(tie, tie + 1)  # every place in a run of equal keys, in key order
        order[pos] = order[pos][np.lexsort((order[pos], k[pos]))]
    return order


_UNITS = (("s", 1, 10**11), ("ms", 10**3, 10**14), ("us", 10**6, 10**17), ("ns", 10**9, None))


def time_unit(top: int) -> str:
    """The unit of event times whose largest magnitude is `top` (see `seconds`)."""
    return next(unit for unit, _, limit in _UNITS if limit is None or top < limit)


def in_seconds(ts: np.ndarray, unit: str) -> np.ndarray:
    return ts // next(per for u, per, _ in _UNITS if u == unit)


def seconds(ts: np.ndarray) -> tuple[np.ndarray, str]:
    """Event times -> epoch seconds, and the unit they were in. Readers keep integer times in
    the input's own unit and give ISO-8601 and fractional times in microseconds, so the unit
    is read from the magnitude: epoch times after 1973 are >= 1e11 in ms, >= 1e14 in us,
    >= 1e17 in ns, and seconds stay below 1e11 until the year 5138."""
    unit = time_unit(int(np.abs(ts).max()) if len(ts) else 0)
    return in_seconds(ts, unit), unit


def _drop_duplicates(
    ev: Interactions, cols: list[np.ndarray], dedup: str, rejects: list[pa.Table]
) -> tuple["np.ndarray | None", np.ndarray]:
    """Which events of `cols` (event index, user code, time, item code; grouped by user, by
    time) `dedup` keeps, None for all; and the duplicates' event indices, sorted, which are
    rejected."""
    order, us, ts, it = cols
    dup = _duplicates(us, ts, it, dedup, ev.has_time)
    if not dup.any():
        return None, np.zeros(0, np.int64)
    same = (
        "same user, item and time as an earlier event" if dedup == "exact" else "same item as the user's previous event"
    )
    rejects.append(_reject_by_event(ev, order[dup], "duplicate_event", same))
    return ~dup, np.sort(order[dup])


def _kept(cols: list[np.ndarray], keep: "np.ndarray | None") -> list[np.ndarray]:
    return cols if keep is None else [c[keep] for c in cols]


def _dense_users(u_sorted: pa.Array, us: np.ndarray, drop_user: np.ndarray) -> tuple[np.ndarray, pa.Array]:
    """Provisional user code -> dense id (rank among the kept users in sorted raw-id order,
    1-based, where kept), and the kept raw ids in that order."""
    keep_user = ~drop_user & (np.bincount(us, minlength=len(drop_user)) > 0)
    return np.cumsum(keep_user), u_sorted.take(pa.array(np.flatnonzero(keep_user)))


def _dense_items(ids: pa.Array, it_kept: np.ndarray) -> tuple[np.ndarray, pa.Array]:
    """Provisional item code (index into `ids`) -> dense id (rank among the kept items in sorted
    raw-id order, 1-based), and the kept raw ids in that order; from the (small) id table, not
    the events."""
    present = np.bincount(it_kept, minlength=len(ids)) > 0
    by_raw = pc.sort_indices(ids).to_numpy()  # provisional codes in sorted raw order
    dense_item = np.empty(len(by_raw), np.int64)
    dense_item[by_raw] = np.cumsum(present[by_raw])
    return dense_item, ids.take(pa.array(by_raw[present[by_raw]]))


def _provisional(ev: Interactions, codes: "tuple | None") -> tuple[np.ndarray, pa.Array, np.ndarray, pa.Array]:
    """Each event's user and item as an index into an id table (user codes, user ids sorted,
    item codes, item ids): hashed here unless `codes` gives them (a bucket knows them)."""
    if codes is not None:
        return codes
    u0, u_sorted = _codes(ev.user)  # provisional user codes, already in sorted raw order
    enc = pc.dictionary_encode(ev.item)  # provisional item codes, first-appearance order
    return u0, u_sorted, enc.indices.to_numpy().astype(np.int64), enc.dictionary


def build_sequences(
    ev: Interactions,
    *,
    dedup: str = "exact",
    max_events: int | None = None,
    raw_times: bool = False,
    part: bool = False,
    codes: "tuple[np.ndarray, pa.Array, np.ndarray, pa.Array] | None" = None,
) -> Sequences:
    """Group, order, de-duplicate, filter and remap (see module doc).

    For a bucket of users (dataprep.bucketed): `part` lets every user be dropped, `raw_times`
    keeps times in the input's unit (the unit is chosen over all buckets), `codes`: _provisional."""
    check_choice("dedup", dedup)
    if len(ev) == 0:
        raise DataprepError(
            f"{', '.join(ev.paths)}: no valid interactions left after rejecting bad rows; "
            "check --format and the rejects listed above"
        )
    rejects = list(ev.rejects)
    u0, u_sorted, i0, i_dict = _provisional(ev, codes)
    order = _order(u0, ev.ts)
    cols = [order, u0[order], ev.ts[order], i0[order]]  # the events in that order: each gathered once
    keep, duplicates = _drop_duplicates(ev, cols, dedup, rejects)
    cols = _kept(cols, keep)
    nu = int(u0.max()) + 1
    drop_user, too_short = _drop_users(ev, cols[1], cols[0], nu, max_events, rejects)
    order, us, ts, it_kept = _kept(cols, ~drop_user[cols[1]] if drop_user.any() else None)
    if len(order) == 0 and not part:
        raise DataprepError(
            f"{', '.join(ev.paths)}: no user has the {MIN_EVENTS} events leave-one-out needs "
            f"({too_short} users too short); give more data"
        )
    dense_user, user_raw = _dense_users(u_sorted, us, drop_user)
    dense_item, item_raw = _dense_items(i_dict, it_kept)
    cnt = np.bincount(dense_user[us] - 1, minlength=len(user_raw))
    offsets = np.concatenate([[0], np.cumsum(cnt)]).astype(np.int64)
    # `order` is grouped by provisional user code, ordered by time inside each user;
    # dense ids follow the same sorted raw order, so the groups are already in place.
    counts = {
        "events_used": int(len(order)),
        "duplicates": len(duplicates),
        "users_read": int((np.bincount(u0, minlength=nu) > 0).sum()),
        "users_rejected": int(drop_user.sum()),
    }
    ts_kept, unit = ((ts, "") if raw_times else seconds(ts)) if ev.has_time else (None, "")
    return Sequences(
        offsets=offsets,
        values=dense_item[it_kept].astype(np.int32),
        user_raw=user_raw,
        item_raw=item_raw,
        rejects=rejects,
        counts=counts,
        timestamps=ts_kept,
        time_unit=unit,
        duplicate_events=duplicates,
    )


def _duplicates(us: np.ndarray, ts: np.ndarray, it: np.ndarray, dedup: str, has_time: bool) -> np.ndarray:
    """Which events (users, times, items in sorted order) `dedup` drops as duplicates."""
    n = len(us)
    same_user = np.empty(n, bool)
    same_user[0] = False
    np.equal(us[1:], us[:-1], out=same_user[1:])
    dup = np.zeros(n, bool)  # in sorted order
    if dedup != "none" and has_time:
        tie = same_user.copy()
        tie[1:] &= ts[1:] == ts[:-1]
        if tie.any():
            # only events inside (user, time) ties can be exact duplicates: sort those by item
            in_tie = tie.copy()
            in_tie[:-1] |= tie[1:]
            idx = np.flatnonzero(in_tie)
            sub = idx[np.lexsort((idx, it[idx], ts[idx], us[idx]))]
            d = (us[sub][1:] == us[sub][:-1]) & (ts[sub][1:] == ts[sub][:-1]) & (it[sub][1:] == it[sub][:-1])
            dup[sub[1:][d]] = True
    if dedup == "consecutive":
        prev_kept = same_user.copy()
        prev_kept[1:] &= it[1:] == it[:-1]
        dup |= prev_kept
    return dup


def _drop_users(
    ev: Interactions, us: np.ndarray, order: np.ndarray, nu: int, max_events: int | None, rejects: list[pa.Table]
) -> tuple[np.ndarray, int]:
    """(users to drop, as a mask over the `nu` user codes; how many were too short): users with
    fewer than MIN_EVENTS events or more than `max_events`, each with a row added to `rejects`.
    `us`, `order`: the kept events' user codes and event indices, grouped by user."""
    cnt = np.bincount(us, minlength=nu)  # per-user event counts
    bad_user = (cnt > 0) & (cnt < MIN_EVENTS)
    reasons = [("too_short", bad_user, lambda c: f"{c} events; leave-one-out needs at least {MIN_EVENTS}")]
    if max_events is not None:
        long_user = cnt > max_events
        reasons.append(("history_too_long", long_user, lambda c: f"{c} events > --max-events {max_events}"))
    first_event = np.full(nu, -1, np.int64)
    group_start = np.flatnonzero(np.r_[True, us[1:] != us[:-1]])  # `us` is grouped by user
    first_event[us[group_start]] = order[group_start]  # each user's earliest event
    drop_user = np.zeros(nu, bool)
    for reason, mask, why in reasons:
        mask = mask & ~drop_user
        if mask.any():
            uu = np.flatnonzero(mask)
            fe = first_event[uu]
            rejects.append(
                pa.table(
                    {
                        "source": pa.array([ev.paths[s] for s in ev.source[fe]], pa.string()),
                        "line": pa.nulls(len(uu), pa.int64()),
                        "user": pc.take(ev.user, pa.array(fe)).cast(pa.string()),
                        "reason": pa.array([reason] * len(uu), pa.string()),
                        "detail": pa.array([why(int(c)) for c in cnt[uu]], pa.string()),
                    }
                )
            )
            drop_user |= mask
    return drop_user, int(bad_user.sum())


def _reject_by_event(ev: Interactions, idx: np.ndarray, reason: str, detail: str) -> pa.Table:
    idx = np.sort(idx)
    return pa.table(
        {
            "source": pa.array([ev.paths[s] for s in ev.source[idx]], pa.string()),
            "line": pa.array(ev.line[idx]),
            "user": pc.take(ev.user, pa.array(idx)).cast(pa.string()),
            "reason": pa.array([reason] * len(idx), pa.string()),
            "detail": pa.array([detail] * len(idx), pa.string()),
        }
    )


def _gather(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate values[starts[k]:starts[k]+lengths[k]] for all k; returns (offsets, flat)."""
    offs = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offs[1:])
    idx = np.arange(offs[-1], dtype=np.int64) + np.repeat(starts - offs[:-1], lengths)
    return offs, values[idx]


def eval_table(seq: Sequences, hold: Holdout | None = None) -> pa.Table:
    """One row per evaluated user (`hold`, default leave-one-out): the history before its
    validation event (untruncated), the validation and the test targets."""
    hold = hold or leave_one_out(seq)
    starts = seq.offsets[:-1][hold.users]
    valid_at = starts + hold.test_at - 1
    hist_off, hist = _gather(seq.values, starts, hold.test_at - 1)
    cols = {
        "user_id": pa.array((hold.users + 1).astype(np.int64)),
        "history": pa.ListArray.from_arrays(
            pa.array(hist_off.astype(np.int32)), pa.array(hist.astype(np.int32, copy=False))
        ),
        "valid_target": pa.array(seq.values[valid_at].astype(np.int32)),
        "test_target": pa.array(seq.values[valid_at + 1].astype(np.int32)),
    }
    if seq.timestamps is not None:
        _, hist_ts = _gather(seq.timestamps, starts, hold.test_at - 1)
        cols["history_timestamps"] = pa.ListArray.from_arrays(pa.array(hist_off.astype(np.int32)), pa.array(hist_ts))
        cols["valid_timestamp"] = pa.array(seq.timestamps[valid_at])
    return pa.table(cols, schema=eval_schema(seq.timestamps is not None))


def train_samples(seq: Sequences, max_len: int, hold: Holdout | None = None) -> Samples:
    """Training samples of each user's training events (`hold`, default leave-one-out: all but
    the validation and test items), the most recent `max_len` inputs kept."""
    if max_len < 1:
        raise DataprepError(f"--max-len {max_len}: must be >= 1")
    train_len = (hold or leave_one_out(seq)).train_len
    has = train_len >= 2  # need one input and one target
    users = np.flatnonzero(has) + 1
    tl = train_len[has]
    length, truncated, items_truncated = sample_lengths(train_len, max_len)
    end = seq.offsets[:-1][has] + tl - 1  # index of the target
    offs, flat = _gather(seq.values, end - length, length)
    ts = None
    if seq.timestamps is not None:
        _, flat_ts = _gather(seq.timestamps, end - length, length)
        ts = pa.LargeListArray.from_arrays(pa.array(offs), pa.array(flat_ts)).cast(pa.list_(pa.int64()))
    values = pa.array(flat.astype(np.int32, copy=False))
    items = (
        pa.LargeListArray.from_arrays(pa.array(offs), values).cast(pa.list_(pa.int32()))
        if offs[-1] >= (1 << 31)
        else pa.ListArray.from_arrays(pa.array(offs.astype(np.int32)), values)
    )
    return Samples(
        user_id=users.astype(np.int64),
        length=length.astype(np.int32),
        items=items,
        target=seq.values[end].astype(np.int32),
        truncated=truncated,
        items_truncated=items_truncated,
        timestamps=ts,
    )


def sample_lengths(train_len: np.ndarray, max_len: int) -> tuple[np.ndarray, int, int]:
    """The input length of the sample of each user with `train_len` >= 2 training events (one
    input and one target), the most recent `max_len` kept; and how many samples and items
    max_len cuts off."""
    tl = train_len[train_len >= 2]
    return np.minimum(tl - 1, max_len), int((tl - 1 > max_len).sum()), int(np.maximum(tl - 1 - max_len, 0).sum())
