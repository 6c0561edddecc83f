"""Which split a training run's shard set is built with, and so which window its gate judges:
the split, split_cut and split_horizon params, the cut and horizon of the `ftrec_interactions`
event that triggered the run, and the data's format, decided by one pure function (`resolve`).

The rule: split "auto" is temporal where the format carries event times (dataprep's
TIME_FORMATS: events, movielens), else leave-one-out. A temporal split's cut is the split_cut
param where set, else the event's `cut`, else dataprep's default (the 0.9 quantile of the event
times); its horizon likewise, each on its own (default: to the last event). An explicit
split=leave_one_out ignores an event's window; a window asked for on data without times fails.
The long form: docs/airflow.md, "plugins/ftrec_airflow/eval_split".
"""

from dataclasses import dataclass
from typing import Any

from ftrec_airflow.pipeline_ops import UserError

SPLITS = ("auto", "leave_one_out", "temporal")


@dataclass(frozen=True)
class RunSplit:
    """A run's split: dataprep's `split`, `cut`, `horizon` (None: dataprep's default) and
    where the cut came from (`source`: "param split_cut", "asset event" or "default")."""

    split: str
    cut: int | None = None
    horizon: int | None = None
    source: str = "default"

    def build_args(self) -> dict[str, Any]:
        """dataprep's settings (ShardSpec's split, cut, horizon)."""
        return {"split": self.split, "cut": self.cut, "horizon": self.horizon}


def _seconds(value: Any, name: str, *, least: int | None = None) -> int | None:
    """An integer number of seconds (None stays None), else UserError naming `name`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{name}={value!r}: must be an integer number of seconds (or empty)")
    if least is not None and value < least:
        raise UserError(f"{name}={value}: must be >= {least} second")
    return value


def event_window(extra: dict[str, Any]) -> dict[str, int]:
    """The `cut` and `horizon` an asset event's extra carries (epoch seconds, seconds >= 1), the
    ones present; UserError names the field."""
    window = {
        "cut": _seconds(extra.get("cut"), "asset event extra 'cut'"),
        "horizon": _seconds(extra.get("horizon"), "asset event extra 'horizon'", least=1),
    }
    return {k: v for k, v in window.items() if v is not None}


def resolve(fmt: str, params: dict[str, Any], event: dict[str, int], time_formats: tuple[str, ...]) -> RunSplit:
    """The run's split (see the module doc) for data of format `fmt`, the DAG run's `params`
    (split, split_cut, split_horizon), the triggering event's window (event_window) and the
    formats that carry event times. UserError names the param (or event field) at fault."""
    split = params.get("split") or "auto"
    if split not in SPLITS:
        raise UserError(f"param split={split!r}: use one of {', '.join(SPLITS)}")
    cut = _seconds(params.get("split_cut"), "param split_cut")
    horizon = _seconds(params.get("split_horizon"), "param split_horizon", least=1)
    timed = fmt in time_formats
    if split == "leave_one_out":
        if cut is not None or horizon is not None:
            raise UserError("params split_cut and split_horizon belong to split=temporal (or auto); clear them")
        return RunSplit("leave_one_out")
    if split == "temporal" and not timed:
        raise UserError(
            f"param split=temporal needs event times, and data_format {fmt} has none; "
            f"use one of {', '.join(time_formats)} or split=leave_one_out"
        )
    if not timed:  # auto on data without times: leave-one-out, unless a window was asked for
        given = ["param split_cut"] * (cut is not None) + ["param split_horizon"] * (horizon is not None)
        given += [f"asset event extra '{k}'" for k in event]
        if given:
            raise UserError(f"{given[0]} asks for a temporal split, and data_format {fmt} has no event times")
        return RunSplit("leave_one_out")
    source = "param split_cut" if cut is not None else "asset event" if "cut" in event else "default"
    cut = cut if cut is not None else event.get("cut")
    horizon = horizon if horizon is not None else event.get("horizon")
    return RunSplit("temporal", cut, horizon, source)


def describe(s: RunSplit) -> str:
    """The window of a split in words, for the task log."""
    if s.split != "temporal":
        return "each user's last event tests"
    cut = "the default cut (quantile 0.9 of the event times)" if s.cut is None else f"cut {s.cut} (from the {s.source})"
    horizon = "the events after it, to the last" if s.horizon is None else f"the {s.horizon} s after it"
    return f"train up to {cut}, test on {horizon}"


def judged(identity: dict[str, Any]) -> dict[str, str]:
    """The split and window the gate judged, from its split identity (training.gate's: the
    eval table's manifest): {"split", "cut", "horizon"}, cut and horizon "" for leave-one-out,
    and "unknown" for an identity written before it said so."""
    return {
        "split": identity.get("kind") or "unknown",
        "cut": identity.get("cut", ""),
        "horizon": identity.get("horizon", ""),
    }
