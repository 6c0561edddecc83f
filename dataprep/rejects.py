"""Rejected input: the rows and users a build leaves out, one table with a reason each
(rejects.parquet, dataprep/schema.py REJECTS_SCHEMA), counted by reason in the manifest, and
the limit past which a build fails instead (--max-reject-fraction)."""

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dataprep import schema
from dataprep.errors import DataprepError

MAX_REJECT_FRACTION = 0.05


def check_rejects(rejects: list[pa.Table], lines: int, max_fraction: float) -> None:
    """Fail when more than `max_fraction` of the input lines were rejected, naming the first."""
    rejected = sum(t.num_rows for t in rejects)
    lines = max(lines, 1)
    if rejected and rejected > max_fraction * lines:
        allr = pa.concat_tables(rejects)
        first = allr.take(pc.sort_indices(allr, [("source", "ascending"), ("line", "ascending")])[:1]).to_pylist()[0]
        raise DataprepError(
            f"{first['source']}: {rejected} of {lines} lines rejected (first: line {first['line']}, "
            f"{first['reason']}, {_unquoted(first['detail'])}); is --format right? "
            f"Fix the input or raise --max-reject-fraction (now {max_fraction})"
        )


def _unquoted(detail: str | None) -> str:
    """A reject's detail without the input it quotes (`...: '<text>'`): an error message never
    shows file content (the file may be a secret posted as data); rejects.parquet keeps it."""
    return re.sub(r": ['\"].*", ": (value not shown)", detail or "")


def tail_rejects(users: pa.Array, sample_ids: np.ndarray) -> pa.Table:
    """The rejects rows of samples the tail policy dropped (`users`: their raw user ids)."""
    n = len(sample_ids)
    return pa.table(
        {
            "source": pa.nulls(n, pa.string()),
            "line": pa.nulls(n, pa.int64()),
            "user": users.cast(pa.string()),
            "reason": pa.array(["tail_dropped"] * n),
            "detail": pa.array([f"sample_id={i}" for i in sample_ids]),
        },
        schema=schema.REJECTS_SCHEMA,
    )


def reject_table(rejects: list[pa.Table]) -> tuple[pa.Table, dict[str, int]]:
    """All rejects tables as one, and the counts by reason."""
    rej = (
        pa.concat_tables([r.cast(schema.REJECTS_SCHEMA) for r in rejects])
        if rejects
        else schema.REJECTS_SCHEMA.empty_table()
    )
    by_reason = {}
    if rej.num_rows:
        vc = pc.value_counts(rej.column("reason")).to_pylist()
        by_reason = {d["values"]: int(d["counts"]) for d in sorted(vc, key=lambda d: d["values"])}
    return rej, by_reason
