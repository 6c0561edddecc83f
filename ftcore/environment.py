"""ftcore's one door to the process environment: every variable ftcore reads is read here, and
what a rank is told is written here (`RankEnv.to_env`), by the local launcher and by the
Kubernetes pods alike. The variables are those docs/cluster.md lists: what torchrun sets (RANK,
WORLD_SIZE) plus the FTCORE_* and FTREC_* ones, the same under torchrun on a cluster and under
the local launcher. Standard library only: timeouts and pace read their settings through it at
import time. A test fails on an `os.environ` read anywhere else in ftcore."""

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def text(name: str, default: str = "") -> str:
    """The variable's value as set; `default` when unset or empty."""
    return os.environ.get(name) or default


def seconds(name: str, default: float) -> float:
    """A duration in seconds, > 0; `default` when unset or empty."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"ftcore: environment variable {name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise SystemExit(f"ftcore: environment variable {name}={raw!r} must be > 0 seconds")
    return value


def number(name: str, default: float) -> float:
    """A number (0 allowed); `default` when unset or empty."""
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError:
        raise SystemExit(f"ftcore: environment variable {name}={raw!r} is not a number") from None


def integer(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ValueError(f"ftcore: environment variable {name}={raw!r} is not an integer") from None


def flag(name: str, default: bool) -> bool:
    """On unless "0" (off unless set and not "0" where `default` is False)."""
    raw = os.environ.get(name, "")
    return default if raw == "" else raw != "0"


def inherited(*, without: tuple[str, ...] = ()) -> dict[str, str]:
    """A copy of this process's environment for a child, less the named variables."""
    return {k: v for k, v in os.environ.items() if k not in without}


def adopt(env: Mapping[str, str]) -> None:
    """Take on `env` (a spare process told its rank's environment only once it is assigned)."""
    os.environ.update(env)


# RankEnv's fields, each the variable that carries it (None values are not written).
_VARIABLES = {
    "lighthouse": "FTCORE_LIGHTHOUSE",
    "job": "FTCORE_JOB_ID",
    "num_groups": "FTREC_NUM_REPLICA_GROUPS",
    "group": "FTREC_REPLICA_GROUP",
    "incarnation": "FTCORE_INCARNATION",
    "rank": "RANK",
    "world": "WORLD_SIZE",
    "min_replicas": "FTCORE_MIN_REPLICAS",
    "lr_policy": "FTCORE_LR_POLICY",
    "token": "FTCORE_TOKEN",
    "token_file": "FTCORE_TOKEN_FILE",
    "host": "FTCORE_HOST",
    "records": "FTCORE_RECORDS",
    "backend": "FTCORE_BACKEND",
    "relay": "FTCORE_RELAY",
    "faults": "FTCORE_FAULTS",
}


@dataclass(frozen=True)
class RankEnv:
    """What a rank is told about its job and its place in it: written by whoever starts ranks
    (`to_env`), read once by the rank (`from_env`). None: not said (the rank's default)."""

    lighthouse: str | None = None  # host:port
    job: str | None = None
    num_groups: int | None = None
    group: int | None = None
    # bumps each time the group is restarted; unset: the group's ranks agree on it (torchrun's
    # restart count is per node, a replaced node starts at 0: it cannot name a group's restart)
    incarnation: int | None = None
    rank: int | None = None
    world: int | None = None
    min_replicas: int | None = None
    lr_policy: str | None = None
    token: str | None = None  # never written to a rank: the launcher hands the job's token as a file
    token_file: str | None = None
    host: str | None = None  # the address this rank binds and advertises (ftcore/netaddr.py)
    records: str | None = None
    backend: str | None = None
    relay: bool | None = None
    faults: str | None = None  # a fault plan (ftcore/faults.py)

    @classmethod
    def from_env(cls) -> "RankEnv":
        values: dict[str, Any] = {}
        kinds = typing.get_type_hints(cls)  # the types, also where annotations are strings
        for f in dataclasses.fields(cls):
            name = _VARIABLES[f.name]
            if not text(name):
                continue
            if kinds[f.name] == int | None:
                values[f.name] = integer(name, 0)
            elif kinds[f.name] == bool | None:
                values[f.name] = flag(name, True)
            else:
                values[f.name] = text(name)
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out[_VARIABLES[f.name]] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        return out


# The fault-tolerance settings a run may choose (training's [ft] section: `--set ft.KEY=VALUE`,
# from a DAG too), each the variable ftcore reads it from. The launcher and the Kubernetes pods
# write them (ft_env); a rank and the lighthouse the launcher hosts read them as their defaults.
FT_SETTINGS = {
    "heartbeat_timeout": "FTCORE_HEARTBEAT_TIMEOUT",
    "failure_probe": "FTCORE_FAILURE_PROBE",
    "stall_probe": "FTCORE_STALL_PROBE",
    "join_timeout": "FTCORE_JOIN_TIMEOUT",
    "collective_timeout": "FTCORE_COLLECTIVE_TIMEOUT",
    "quorum_timeout": "FTCORE_QUORUM_TIMEOUT",
    "heal_timeout": "FTCORE_HEAL_TIMEOUT",
    "lease": "FTCORE_LEASE",
    "relay": "FTCORE_RELAY",
}


def ft_env(settings: dict[str, Any]) -> dict[str, str]:
    """The environment that carries `settings` (FT_SETTINGS' names) to a rank and a lighthouse."""
    return {FT_SETTINGS[k]: ("1" if v else "0") if isinstance(v, bool) else repr(v) for k, v in settings.items()}


def ft_defaults() -> dict[str, Any]:
    """Each FT setting's value in this process: what its environment sets, else ftcore's default."""
    from ftcore import timeouts

    values = {k: getattr(timeouts, v.removeprefix("FTCORE_")) for k, v in FT_SETTINGS.items() if k != "relay"}
    return values | {"relay": flag("FTCORE_RELAY", True)}
