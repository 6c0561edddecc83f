"""What a launch is asked to do (LaunchConfig) and the errors it reports."""

from dataclasses import dataclass, field

TOY = "ftcore.examples.toy"


class LaunchError(RuntimeError):
    """A user-fixable launcher error: one line, no traceback."""


class GroupFailed(RuntimeError):
    """A replica group's attempt ended badly: the supervisor restarts it."""


@dataclass
class LaunchConfig:
    shards: str | None = None
    replica_groups: int = 2
    ranks_per_group: int = 1
    lighthouse: str | None = None
    job_id: str = "default"
    groups: list[int] | None = None  # the replica groups this launcher runs (None: all R)
    faults: str | None = None
    out: str = "work/launch"
    worker: str = TOY  # a module with main(argv): what every rank runs
    min_replicas: int = 1
    max_restarts: int = 5
    backoff_s: float = 0.1
    replace_after: float = 15.0
    timeout: float = 3600.0
    spares: bool = True
    lr_policy: str = "sqrt"
    extra: list[str] = field(default_factory=list)
    print_commands: bool = False
    oversubscribe_gpus: bool = False  # groups may share GPUs (never two ranks of one group)
