"""The manager's configuration, and how a rank makes it from what it was told (RankEnv)."""

from dataclasses import dataclass
from typing import Any

from ftcore import auth, netaddr
from ftcore import faults as faults_mod
from ftcore.environment import RankEnv
from ftcore.ftar import DEFAULT_BUCKET_BYTES

LR_POLICIES = ("none", "linear", "sqrt")


@dataclass
class ManagerConfig:
    lighthouse: str  # host:port
    group: int  # this replica group, 0..num_groups-1
    num_groups: int  # R: replica groups the job was planned with (LR policy, make-up)
    rank: int = 0  # k: rank within the group
    world: int = 1  # K: ranks per group
    incarnation: int | None = 0  # bumps each time the group is restarted; None: agreed at start
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


def config_from_env(**overrides: Any) -> ManagerConfig:
    """The manager's configuration from the rank's environment (docs/cluster.md)."""
    told = RankEnv.from_env()
    if not told.lighthouse:
        raise ValueError(
            "ftcore: FTCORE_LIGHTHOUSE is not set; start ranks with the launcher "
            "(python -m training launch) or set it to the lighthouse's host:port"
        )
    job = told.job or "default"
    cfg = ManagerConfig(
        lighthouse=told.lighthouse,
        group=told.group or 0,
        num_groups=1 if told.num_groups is None else told.num_groups,
        rank=told.rank or 0,
        world=1 if told.world is None else told.world,
        incarnation=told.incarnation,  # unset: the group's ranks agree on it (RankEnv)
        min_replicas=1 if told.min_replicas is None else told.min_replicas,
        lr_policy=told.lr_policy or "sqrt",
        token=_job_token(auth.token_from_env(), job),
        host=netaddr.rank_host(told.lighthouse),
        job=job,
        records=told.records,
        backend=told.backend or "gloo",
        relay=told.relay is not False,
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


def faults_from_env() -> list[faults_mod.Fault]:
    path = RankEnv.from_env().faults
    return faults_mod.load(path) if path else []
