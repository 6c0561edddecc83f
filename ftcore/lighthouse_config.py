"""The lighthouse's settings, one table: each field's default, help and floor. The command line
(`python -m ftcore.lighthouse --help`) and its checks are derived from it (ftcore/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ftcore import timeouts
from ftcore.pace import PacePolicy
from ftcore.settings import setting


@dataclass
class LighthouseConfig:
    bind: str = setting(
        "127.0.0.1:0",
        "host:port to listen on (loopback by default; the command line's default port 29510 is a standing "
        "service's well-known one, the library's 0 an embedded lighthouse's free one)",
        cli_default="127.0.0.1:29510",
    )
    min_replicas: int = setting(
        1, "fewest replica groups a quorum may have (a floor: a job may ask for more)", at_least=1
    )
    expected_replicas: int = setting(
        0, "groups a job starts with when its ranks do not say: its first quorum waits for all of them", at_least=0
    )
    join_timeout: float = setting(timeouts.JOIN_TIMEOUT, "seconds a round waits for a member to ask", above=0)
    heartbeat_timeout: float = setting(
        timeouts.HEARTBEAT_TIMEOUT, "seconds without a heartbeat before a rank is judged gone", above=0
    )
    start_timeout: float = setting(
        timeouts.START_TIMEOUT,
        "seconds a job's first quorum waits for an expected group not yet heard (still starting)",
        at_least=0,
    )
    failure_probe: float = setting(
        timeouts.FAILURE_PROBE, "seconds a failure probe waits to hear an accused member", above=0
    )
    stall_probe: float = setting(
        timeouts.STALL_PROBE, "seconds a round waits on a member before it probes the quorum", above=0
    )
    # the admin secret; each job's token derives from it (auth.job_token); the command line reads
    # it from --token-file or the environment, never from an argument
    token: str | None = None
    events_file: str | None = setting(None, "append every event to this JSON-lines file", kind=str)
    lease: float = setting(
        timeouts.LEASE,
        "seconds a group may go on in its last quorum while this lighthouse is silent (0: never)",
        at_least=0,
    )
    pause_grace: bool = setting(
        True, "judge heartbeat timeouts at once after this process was paused (for comparison only)"
    )
    pace: PacePolicy = setting(default_factory=PacePolicy, nested=True)  # fail-slow (ftcore/pace.py)
    max_jobs: int = setting(4096, "live jobs at once (retired ones do not count)", at_least=1)
    job_idle_s: float = setting(
        600.0, "seconds without any rank of a job before it retires", flag="--job-idle", at_least=0
    )
    finished_linger_s: float = setting(
        60.0,
        "seconds a retired finished job's last step is remembered (a late group is told the job finished)",
        flag="--finished-linger",
        at_least=0,
    )
    max_ranks_per_job: int = setting(
        1 << 17,
        "ranks one job may register (each group's ranks, summed): one job's token cannot fill this lighthouse",
        at_least=1,
    )
    events_per_job: int = setting(1000, "the most recent events each live job keeps in memory", at_least=1)
    max_connections: int = setting(65536, "open connections in total", at_least=1)
    max_connections_per_peer: int = setting(
        16384, "open connections from one address (two per rank on that host)", at_least=1
    )
    max_unauthenticated_per_peer: int = setting(
        256, "connections from one address that sent no valid token yet (past it the oldest is closed)", at_least=1
    )
    # a job holds at most max(min_connections_per_job, connections_per_rank x its ranks' heartbeat
    # lines), and of a full lighthouse its share (ftcore/lighthouse_admission.py)
    min_connections_per_job: int = setting(
        64, "connections a job may hold however few ranks it has (past its bound its idle ones close)", at_least=1
    )
    connections_per_rank: int = setting(
        4, "connections a job may hold per heartbeat line of its ranks (a rank holds two)", at_least=1
    )
    heartbeat_budget: float = setting(
        4000.0,
        "heartbeats/s this lighthouse takes from all jobs; past it every speaker is asked to beat slower "
        "(at most a quarter of the heartbeat timeout apart)",
        above=0,
    )
