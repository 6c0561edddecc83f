"""Settings as dataclass fields: each field is one row of its table (default, help, floor), and
a service's command line and its checks are derived from the table, never restated beside it.

`setting(...)` makes such a field; a plain field is not on the command line. Its flag is
`--name-with-dashes` unless it says otherwise (`flag=None`: off the command line); a True or
False default becomes a `--no-name` or `--name` switch; a field holding another settings table
(`nested=True`) adds that table's flags."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

_DERIVED = ""  # setting(flag=...) default: the flag comes from the field's name


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: str | None = _DERIVED,
    kind: type | None = None,
    at_least: float | None = None,
    above: float | None = None,
    cli_default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
    nested: bool = False,
) -> Any:
    """A settings field. `kind`: the value's type where the default (None) does not say it;
    `at_least`/`above`: its floor, checked by `check`; `cli_default`: the command line's default
    where it differs from the library's, with the reason in `help`."""
    meta = {"help": help, "flag": None if nested else flag, "kind": kind, "at_least": at_least, "above": above}
    meta |= {"cli_default": cli_default, "nested": nested}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _default(f: dataclasses.Field) -> Any:
    if f.metadata.get("cli_default", dataclasses.MISSING) is not dataclasses.MISSING:
        return f.metadata["cli_default"]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[operator]


def flag_of(f: dataclasses.Field) -> str | None:
    """The field's flag; None for a plain field (not made by `setting`) or one marked off the line."""
    if "flag" not in f.metadata:
        return None
    flag = f.metadata["flag"]
    if flag != _DERIVED:
        return flag
    name = f.name.replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


def add_arguments(p: argparse.ArgumentParser, table: type, prefix: str = "") -> None:
    """One argument per field of `table` that has a flag; its value lands at dest
    `prefix + name` (a nested table's fields under `name.`)."""
    for f in dataclasses.fields(table):
        default = _default(f)
        if f.metadata.get("nested"):
            add_arguments(p, type(default), f"{prefix}{f.name}.")
            continue
        flag = flag_of(f)
        if flag is None:
            continue
        dest, help_ = prefix + f.name, f.metadata.get("help", "")
        if isinstance(default, bool):
            p.add_argument(flag, dest=dest, action="store_false" if default else "store_true", help=help_)
        else:
            kind = f.metadata.get("kind") or type(default)
            shown = "" if default is None else " (default: %(default)s)"
            metavar = flag.lstrip("-").replace("-", "_").upper()
            p.add_argument(flag, dest=dest, type=kind, default=default, metavar=metavar, help=help_ + shown)


def from_args(table: type, values: dict[str, Any], prefix: str = "", **given: Any) -> Any:
    """An instance of `table` from parsed arguments (`vars(namespace)`); fields off the command
    line keep their defaults unless `given`."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(table):
        if f.metadata.get("nested"):
            kw[f.name] = from_args(type(_default(f)), values, f"{prefix}{f.name}.")
        elif prefix + f.name in values:
            kw[f.name] = values[prefix + f.name]
    return table(**(kw | given))


def check(obj: Any) -> Any:
    """`obj` when every field is at or above its floor (nested tables too); else ValueError
    naming the setting by its flag (or its field where it has none)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.metadata.get("nested"):
            check(v)
            continue
        name = flag_of(f) or f.name
        lo, above = f.metadata.get("at_least"), f.metadata.get("above")
        if v is not None and lo is not None and not v >= lo:
            raise ValueError(f"{name} must be >= {lo:g}, got {v}")
        if v is not None and above is not None and not v > above:
            raise ValueError(f"{name} must be > {above:g}, got {v}")
    return obj
