"""Raw values typed: ids (int64 or opaque text), times (int64), booleans; and the rejects table of
rows whose values fail (one row per rejected input line)."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dataprep.errors import DataprepError
from dataprep.schema import REJECTS_SCHEMA

INT64_MAX = str(2**63 - 1)


def rejected_rows(source: str, lines, reason: str, details=None, users=None) -> pa.Table:
    n = len(lines)
    return pa.table(
        {
            "source": pa.array([source] * n, pa.string()),
            "line": pa.array(np.asarray(lines, dtype=np.int64)),
            "user": pa.array(users if users is not None else [None] * n, pa.string()),
            "reason": pa.array([reason] * n, pa.string()),
            "detail": pa.array(details if details is not None else [None] * n, pa.string()),
        },
        schema=REJECTS_SCHEMA,
    )


def as_bool(mask) -> np.ndarray:
    """A boolean pyarrow array as numpy, null read as False."""
    return np.asarray(pc.fill_null(mask, False).to_numpy(zero_copy_only=False), bool)


def matches(a: pa.Array, pattern: str) -> np.ndarray:
    return as_bool(pc.match_substring_regex(a, pattern))


def cast_rows(a: pa.Array, typ: pa.DataType) -> tuple[pa.Array, np.ndarray]:
    """`a` cast to `typ`, and which values cast (the others read as null). One vectorized cast
    when all do; else halves until the few bad ones are found (callers pre-filter by shape)."""
    try:
        return a.cast(typ), np.ones(len(a), bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        if len(a) <= 1:
            return pa.nulls(len(a), typ), np.zeros(len(a), bool)
        h = len(a) // 2
        (x, ox), (y, oy) = cast_rows(a.slice(0, h), typ), cast_rows(a.slice(h), typ)
        return pa.concat_arrays([x, y]), np.concatenate([ox, oy])


_TIME_INT = r"^[+-]?[0-9]{1,19}$"
_TIME_NUM = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$"
_TIME_ISO = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}"  # date
    r"([T ][0-9]{2}(:[0-9]{2}(:[0-9]{2}(\.[0-9]{1,9})?)?)?)?"  # [time[:min[:sec[.frac]]]]
    r"(Z|[+-][0-9]{2}(:?[0-9]{2})?)?$"
)  # [zone]
_TIME_ZONE = r"[T ][0-9:.]+(Z|[+-][0-9]{2}(:?[0-9]{2})?)$"


def parse_times(s: pa.Array, int_only: bool = False) -> tuple[pa.Array, np.ndarray, str]:
    """String timestamps -> int64, row by row. Returns the values (null where missing or bad),
    which rows are bad, and what a good value looks like. A column holds one kind of time:
    ISO-8601 if more of its values are that than numbers (-> microseconds, UTC; times without a zone
    read as UTC), else numbers: integers if all are (epoch, any unit, kept as they are), else seconds
    with a fraction (-> microseconds). A value not of the column's kind is a bad row."""
    s = pc.utf8_trim_whitespace(s)
    n = len(s)
    for typ in (pa.int64(),) if int_only else (pa.int64(), pa.timestamp("us")):
        try:  # a clean column: one cast, no per-row work
            return s.cast(typ).cast(pa.int64()), np.zeros(n, bool), ""
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    vals, ok = np.zeros(n, np.int64), np.zeros(n, bool)
    is_int, is_num = matches(s, _TIME_INT), matches(s, _TIME_NUM)
    is_iso = np.zeros(n, bool) if int_only else matches(s, _TIME_ISO)

    def put(mask, typ):
        v, good = cast_rows(pc.filter(s, pa.array(mask)), typ)
        vals[mask] = pc.fill_null(v.cast(pa.int64()), 0).to_numpy()
        ok[mask] = good

    if is_iso.sum() > is_num.sum():
        zoned = is_iso & matches(s, _TIME_ZONE)
        put(is_iso & ~zoned, pa.timestamp("us"))
        put(zoned, pa.timestamp("us", tz="UTC"))
        what = "an ISO-8601 time like the column's others"
    elif int_only or is_int.sum() == is_num.sum():
        put(is_int, pa.int64())  # 19 digits may still overflow: cast_rows finds those
        what = "an integer (epoch) like the column's others"
    else:
        us = np.round(pc.filter(s, pa.array(is_num)).cast(pa.float64()).to_numpy() * 1e6)
        fits = np.isfinite(us) & (np.abs(us) < 2.0**63)
        vals[is_num] = np.where(fits, us, 0).astype(np.int64)
        ok[is_num] = fits
        what = "a number (epoch seconds) like the column's others"
    null = np.asarray(s.is_null().to_numpy(zero_copy_only=False), bool)
    bad = ~ok & ~null
    return pa.array(vals, mask=~ok), bad, what


def as_id(arr, path: str, col: str) -> pa.Array:
    a = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    if pa.types.is_dictionary(a.type):
        a = a.cast(a.type.value_type)
    if pa.types.is_integer(a.type):
        try:
            return a.cast(pa.int64())
        except pa.ArrowInvalid:  # uint64 above int64: ids are opaque, keep them exact as text
            return a.cast(pa.string())
    if pa.types.is_string(a.type) or pa.types.is_large_string(a.type):
        return a.cast(pa.string())
    if pa.types.is_floating(a.type):
        vals = a.to_numpy(zero_copy_only=False)
        finite = np.isfinite(vals)
        v = vals[finite]
        frac = v[v != np.round(v)]
        if len(frac):
            raise DataprepError(
                f"{path}: column {col!r} holds non-integer numbers (for example {frac[0]}); "
                "ids must be integers or strings"
            )
        big = v[np.abs(v) >= 2.0**63]
        if len(big):
            raise DataprepError(
                f"{path}: column {col!r} holds numbers beyond int64 (for example {big[0]:g}); "
                "store large ids as integers or strings, not floats"
            )
        return pa.array(np.where(finite, vals, 0).astype(np.int64), mask=~finite | np.asarray(a.is_null()))
    raise DataprepError(f"{path}: column {col!r} has type {a.type}; ids must be integers or strings")


def csv_ids(a: pa.Array) -> pa.Array:
    """CSV ids typed as pyarrow would infer them, but never lossily: int64 when every id is one,
    whole floats as integers (see as_id); else opaque strings (an id above int64 stays exact)."""
    try:
        return a.cast(pa.int64())
    except pa.ArrowInvalid:
        pass
    if not pc.all(pc.match_substring_regex(a, r"^[+-]?[0-9]+$")).as_py():
        try:
            return a.cast(pa.float64())
        except pa.ArrowInvalid:
            pass
    return a


def as_time(arr, path: str, col: str) -> tuple[pa.Array, np.ndarray, str]:
    """Timestamps as int64 (nulls kept) and the rows whose value is not a time (strings only)."""
    a = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    if pa.types.is_dictionary(a.type):
        a = a.cast(a.type.value_type)
    t = a.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return parse_times(a.cast(pa.string()))
    none = np.zeros(len(a), bool)
    try:
        if pa.types.is_timestamp(t):
            return a.cast(pa.timestamp("us")).cast(pa.int64()), none, ""
        if pa.types.is_date(t):
            return a.cast(pa.timestamp("s")).cast(pa.int64()), none, ""
        if pa.types.is_integer(t):
            return a.cast(pa.int64()), none, ""
        if pa.types.is_floating(t):
            # fractional seconds kept to the microsecond
            return pc.round(pc.multiply(a, 1e6)).cast(pa.int64()), none, ""
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise DataprepError(
            f"{path}: column {col!r} is not a readable timestamp ({str(e).splitlines()[0]}); "
            "use integers (epoch) or ISO-8601 times"
        ) from None
    raise DataprepError(
        f"{path}: column {col!r} has type {t}; timestamps must be integers, floats, dates, times or strings of those"
    )
