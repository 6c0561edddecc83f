"""One rank's configuration: what torchrun sets (RANK, WORLD_SIZE) plus the FTCORE_* and
FTREC_* variables docs/cluster.md lists, the same under torchrun on a
cluster and under the local launcher."""

import os
from dataclasses import dataclass
from typing import Any

from ftcore import auth, netaddr
from ftcore import faults as faults_mod
from ftcore.ftar import DEFAULT_BUCKET_BYTES

LR_POLICIES = ("none", "linear", "sqrt")


@dataclass
class ManagerConfig:
    lighthouse: str  # host:port
    group: int  # this replica group, 0..num_groups-1
    num_groups: int  # R: replica groups the job was planned with (LR policy, make-up)
    rank: int = 0  # k: rank within the group
    world: int = 1  # K: ranks per group
    incarnation: int | None = 0  # bumps each time the group is restarted; None: agreed at start (see below)
    min_replicas: int = 1
    lr_policy: str = "sqrt"
    token: str | None = None
    host: str = ""  # where this rank's store, heal server and gloo listen (ftcore/netaddr.py)
    job: str = "default"  # one lighthouse serves several jobs; their quorums never mix
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    records: str | None = None  # append every StepRecord here as a JSON line ("{incarnation}" is filled in)
    # cross-group data plane: "gloo" always, CUDA gradients host-staged (ftcore/ftar.py says why).
    # "nccl" is fenced: opt-in only (FTCORE_BACKEND=nccl), never run on a GPU here, and a hung
    # peer there is ended by NCCL's watchdog tearing the survivors down, not by FTAR (ftcore/crossgroup.py).
    backend: str = "gloo"
    # a group of several ranks speaks to the lighthouse through its rank 0 (ftcore/relay.py)
    relay: bool = True


def _env_int(name: str, default: str) -> int:
    raw = os.environ.get(name, default)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"ftcore: environment variable {name}={raw!r} is not an integer") from None


def config_from_env(**overrides: Any) -> ManagerConfig:
    """The manager's configuration from the rank's environment (docs/cluster.md)."""
    env = os.environ
    if not env.get("FTCORE_LIGHTHOUSE"):
        raise ValueError(
            "ftcore: FTCORE_LIGHTHOUSE is not set; start ranks with the launcher "
            "(python -m training launch) or set it to the lighthouse's host:port"
        )
    cfg = ManagerConfig(
        lighthouse=env["FTCORE_LIGHTHOUSE"],
        group=_env_int("FTREC_REPLICA_GROUP", "0"),
        num_groups=_env_int("FTREC_NUM_REPLICA_GROUPS", "1"),
        rank=_env_int("RANK", "0"),
        world=_env_int("WORLD_SIZE", "1"),
        # torchrun's restart count is per node (a replaced node starts at 0), so it cannot name
        # a restart of a group that spans nodes: without FTCORE_INCARNATION the ranks agree.
        incarnation=_env_int("FTCORE_INCARNATION", "0") if env.get("FTCORE_INCARNATION") else None,
        min_replicas=_env_int("FTCORE_MIN_REPLICAS", "1"),
        lr_policy=env.get("FTCORE_LR_POLICY", "sqrt"),
        token=_job_token(auth.token_from_env(), env.get("FTCORE_JOB_ID") or "default"),
        host=netaddr.rank_host(env["FTCORE_LIGHTHOUSE"]),
        job=env.get("FTCORE_JOB_ID") or "default",
        records=env.get("FTCORE_RECORDS"),
        backend=env.get("FTCORE_BACKEND", "gloo"),
        relay=env.get("FTCORE_RELAY", "1") != "0",
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _job_token(token: str | None, job: str) -> str | None:
    """The credential a rank uses on the wire and serves heals under: its job's token, even when
    it was handed the lighthouse's secret (ftcore/auth.py)."""
    try:
        return auth.job_token(token, job) if token else None
    except ValueError as e:
        raise ValueError(f"ftcore: FTCORE_TOKEN / FTCORE_TOKEN_FILE: {e}") from None


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
    return values | {"relay": os.environ.get("FTCORE_RELAY", "1") != "0"}


def faults_from_env() -> list[faults_mod.Fault]:
    path = os.environ.get("FTCORE_FAULTS")
    return faults_mod.load(path) if path else []
