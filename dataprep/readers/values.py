"""Raw values typed: ids (int64 or opaque text), times (int64), booleans; and the rejects table of
rows whose values fail (one row per rejected input line)."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dataprep.errors import DataprepError, cause
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


def time_kind(s: pa.Array, int_only: bool = False) -> tuple[str, tuple[bool, bool, int, int, int]]:
    """parse_times' choice for trimmed strings `s` alone ("int64", "ts": one clean cast; "iso",
    "int", "num": by counts), and the figures that choose it for a whole column of parts
    (merge_time_kinds): (int64 cast ok, timestamp cast ok, ISO, number and integer counts)."""
    ok: list[bool] = []
    for typ in (pa.int64(), pa.timestamp("us")):
        if ok and ok[0]:  # integers: a timestamp only if there is no value (pyarrow wants YYYY-MM-DD)
            ok.append(s.null_count == len(s))
            break
        try:
            s.cast(typ)
            ok.append(True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            ok.append(False)
    if ok[0]:  # every value an integer: no ISO time among them
        nn = len(s) - s.null_count
        return "int64", (True, ok[1], 0, nn, nn)
    iso = 0 if int_only else int(matches(s, _TIME_ISO).sum())
    num, whole = int(matches(s, _TIME_NUM).sum()), int(matches(s, _TIME_INT).sum())
    figures = (False, ok[1], iso, num, whole)
    return merge_time_kinds([figures], int_only), figures


def merge_time_kinds(parts: "list[tuple[bool, bool, int, int, int]]", int_only: bool = False) -> str:
    """The kind parse_times chooses for the column made of parts with these figures (time_kind)."""
    if all(p[0] for p in parts):
        return "int64"
    if not int_only and all(p[1] for p in parts):
        return "ts"
    iso, num, whole = (sum(p[k] for p in parts) for k in (2, 3, 4))
    if iso > num:
        return "iso"
    return "int" if int_only or whole == num else "num"


def parse_times(s: pa.Array, int_only: bool = False, kind: str | None = None) -> tuple[pa.Array, np.ndarray, str]:
    """String timestamps -> int64, row by row. Returns the values (null where missing or bad),
    which rows are bad, and what a good value looks like. A column holds one kind of time:
    ISO-8601 if more of its values are that than numbers (-> microseconds, UTC; times without a zone
    read as UTC), else numbers: integers if all are (epoch, any unit, kept as they are), else seconds
    with a fraction (-> microseconds). A value not of the column's kind is a bad row. `kind`: the
    whole column's (time_kind, merge_time_kinds) when `s` is a part of it."""
    s = pc.utf8_trim_whitespace(s)
    n = len(s)
    kind = kind or time_kind(s, int_only)[0]
    if kind in ("int64", "ts"):  # a clean column: one cast, no per-row work
        return s.cast(pa.int64() if kind == "int64" else pa.timestamp("us")).cast(pa.int64()), np.zeros(n, bool), ""
    vals, ok = np.zeros(n, np.int64), np.zeros(n, bool)

    def put(mask, typ):
        v, good = cast_rows(pc.filter(s, pa.array(mask)), typ)
        vals[mask] = pc.fill_null(v.cast(pa.int64()), 0).to_numpy()
        ok[mask] = good

    if kind == "iso":
        is_iso = matches(s, _TIME_ISO)
        zoned = is_iso & matches(s, _TIME_ZONE)
        put(is_iso & ~zoned, pa.timestamp("us"))
        put(zoned, pa.timestamp("us", tz="UTC"))
        what = "an ISO-8601 time like the column's others"
    elif kind == "int":
        put(matches(s, _TIME_INT), pa.int64())  # 19 digits may still overflow: cast_rows finds those
        what = "an integer (epoch) like the column's others"
    else:
        is_num = matches(s, _TIME_NUM)
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


def id_kind(a: pa.Array) -> tuple[str, bool]:
    """csv_ids' choice for `a` alone ("int", "float" or "text") and whether float64 takes every
    value (merge_id_kinds decides a whole column of parts from these)."""
    try:
        a.cast(pa.int64())
        return "int", True
    except pa.ArrowInvalid:
        pass
    if pc.all(pc.match_substring_regex(a, r"^[+-]?[0-9]+$")).as_py():
        return "text", True  # integers beyond int64: exact as text
    try:
        a.cast(pa.float64())
        return "float", True
    except pa.ArrowInvalid:
        return "text", False


def merge_id_kinds(parts: "list[tuple[str, bool]]") -> str:
    """The kind csv_ids chooses for the column made of parts of these kinds (id_kind)."""
    if all(k == "int" for k, _ in parts):
        return "int"
    integers = all(k == "int" or (k == "text" and floats) for k, floats in parts)
    return "float" if not integers and all(floats for _, floats in parts) else "text"


def csv_ids(a: pa.Array, kind: str | None = None) -> pa.Array:
    """CSV ids typed as pyarrow would infer them, but never lossily: int64 when every id is one,
    whole floats as integers (see as_id); else opaque strings (an id above int64 stays exact).
    `kind`: the whole column's (id_kind, merge_id_kinds) when `a` is a part of it."""
    kind = kind or id_kind(a)[0]
    return a.cast(pa.int64()) if kind == "int" else a.cast(pa.float64()) if kind == "float" else a


def as_time(arr, path: str, col: str, kind: str | None = None) -> tuple[pa.Array, np.ndarray, str]:
    """Timestamps as int64 (nulls kept) and the rows whose value is not a time (strings only;
    `kind`: parse_times')."""
    a = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    if pa.types.is_dictionary(a.type):
        a = a.cast(a.type.value_type)
    t = a.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return parse_times(a.cast(pa.string()), kind=kind)
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
            f"{path}: column {col!r} is not a readable timestamp ({cause(e)}); use integers (epoch) or ISO-8601 times"
        ) from None
    raise DataprepError(
        f"{path}: column {col!r} has type {t}; timestamps must be integers, floats, dates, times or strings of those"
    )
