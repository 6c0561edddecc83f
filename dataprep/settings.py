"""ShardSettings: the settings that decide a shard set's content, as one checked, frozen record.

The CLI, the Airflow tasks and the benchmarks build one; build.prepare turns it into the set's
config (the manifest's `config`). Every setting is checked here, when the record is made, and a
DataprepError names the setting's flag (--tail, --world-size) and what it may be. What depends
on the input (a temporal split needs a format with times) prepare checks.
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Literal, get_args

from dataprep.errors import DataprepError
from dataprep.rejects import MAX_REJECT_FRACTION

Tail = Literal["fill", "drop"]  # the N mod W*B leftover samples: spread over the steps, or dropped
Method = Literal["auto", "lpt", "kk"]  # the partitioner (dataprep/balance.py)
Dedup = Literal["exact", "consecutive", "none"]  # which repeated events are dropped (dataprep/sequences.py)
Split = Literal["leave_one_out", "temporal"]  # what evaluation holds out (dataprep/temporal.py)
TAILS: tuple[Tail, ...] = get_args(Tail)
METHODS: tuple[Method, ...] = get_args(Method)
DEDUP: tuple[Dedup, ...] = get_args(Dedup)
SPLITS: tuple[Split, ...] = get_args(Split)
# each choice setting: its choices, and what its message says before them
_CHOICES: dict[str, tuple[tuple[str, ...], str]] = {
    "tail": (TAILS, ""),
    "method": (METHODS, ""),
    "dedup": (DEDUP, "unknown; "),
    "split": (SPLITS, "unknown; "),
}


def check_choice(name: str, value: object) -> None:
    """`value` is one of the choice setting `name`'s (tail, method, dedup, split), else a
    DataprepError naming its flag and the choices."""
    allowed, unknown = _CHOICES[name]
    if value not in allowed:
        raise DataprepError(f"--{name} {value!r}: {unknown}choose one of {', '.join(allowed)}")


def _check_counts(**counts: int) -> None:
    """Each setting (world_size=...) is >= 1, else a DataprepError naming its flag."""
    bad = [k for k, v in counts.items() if v < 1]
    if bad:
        raise DataprepError(f"--{bad[0].replace('_', '-')} must be >= 1")


@dataclass(frozen=True)
class ShardSettings:
    """What a shard set is built with (docs/dataprep.md; the CLI's `shards` flags of the same names).

    `reader_options`: the readers' column names (user_col, item_col, time_col), kept read-only."""

    world_size: int  # data-parallel ranks W
    batch_size: int  # samples per rank per step, on average
    seed: int = 0
    max_len: int = 50  # longest input history kept, most recent
    cost_model: "str | os.PathLike | dict | None" = None  # a `calibrate` JSON file or {a, b, c0}; None: built in
    window_steps: int | None = None  # K, steps per cost-sorted window; None: balance.DEFAULT_WINDOW_STEPS
    tail: Tail = "fill"
    method: Method = "auto"
    dedup: Dedup = "exact"
    max_events: int | None = None  # users with more events are rejected (bots)
    max_reject_fraction: float = MAX_REJECT_FRACTION
    split: Split = "leave_one_out"
    cut: int | None = None  # temporal: the cut, epoch seconds (None: a quantile of the event times)
    horizon: int | None = None  # temporal: seconds after the cut a test event may be (None: all)
    reader_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "reader_options", MappingProxyType(dict(self.reader_options)))
        counts = {"world_size": self.world_size, "batch_size": self.batch_size, "max_len": self.max_len}
        _check_counts(**counts, **({} if self.window_steps is None else {"window_steps": self.window_steps}))
        for name in _CHOICES:
            check_choice(name, getattr(self, name))
        if self.split == "leave_one_out" and (self.cut is not None or self.horizon is not None):
            raise DataprepError("--cut and --horizon belong to --split temporal")
        if self.horizon is not None and self.horizon < 1:
            raise DataprepError(f"--horizon {self.horizon}: must be >= 1 second")

    @classmethod
    def from_kwargs(cls, **kw: Any) -> "ShardSettings":
        """The record of keyword settings, as build_shards takes them: each field by its name,
        any other keyword a reader option (user_col=...), added to `reader_options`."""
        names = {f.name for f in fields(cls)}
        own = {k: v for k, v in kw.items() if k in names}
        extra = {k: v for k, v in kw.items() if k not in names}
        return cls(**own | {"reader_options": {**own.get("reader_options", {}), **extra}})
