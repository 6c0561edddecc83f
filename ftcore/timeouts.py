"""Every timeout of ftcore, in one place, each overridable by an environment variable. A hang
is seen by the heartbeat before a collective gives up on it, and a collective gives up before
a quorum request does: HEARTBEAT_INTERVAL < HEARTBEAT_TIMEOUT < COLLECTIVE_TIMEOUT <=
QUORUM_TIMEOUT. Crashes wait for none of them: a killed peer resets its connections."""

from ftcore.environment import number, seconds


def _lease() -> float:
    """FTCORE_LEASE: seconds, 0 for none (unset: 30)."""
    value = number("FTCORE_LEASE", 30.0)
    if value < 0:
        raise SystemExit(f"ftcore: environment variable FTCORE_LEASE={value} must be >= 0 seconds (0: no lease)")
    return value


# How often every rank tells the lighthouse it is alive.
HEARTBEAT_INTERVAL = seconds("FTCORE_HEARTBEAT_INTERVAL", 0.05)
# A rank silent for this long is declared failed (hangs, SIGSTOP); crashes are faster.
HEARTBEAT_TIMEOUT = seconds("FTCORE_HEARTBEAT_TIMEOUT", 2.0)
# After a data-plane failure report, members that do not heartbeat within this
# window are declared failed (a few heartbeat intervals).
FAILURE_PROBE = seconds("FTCORE_FAILURE_PROBE", 0.2)
# An FTAR wait that makes no progress for this long asks the lighthouse to probe its members
# at once (FailureReport.stalled): a partitioned peer closes no connection, and its silence
# would otherwise take HEARTBEAT_TIMEOUT to judge. Above a step's normal skew between groups.
STALL_PROBE = seconds("FTCORE_STALL_PROBE", 0.5)
# Bound on one cross-group collective (every bucket of an FTAR) and on building a group.
COLLECTIVE_TIMEOUT = seconds("FTCORE_COLLECTIVE_TIMEOUT", 5.0)
# Bound on one quorum request, including reconnecting to a restarting lighthouse.
QUORUM_TIMEOUT = seconds("FTCORE_QUORUM_TIMEOUT", 10.0)
# Lighthouse: how long a round waits for a healthy but slow member before going on
# without it (it must exceed the normal step-time skew between groups).
JOIN_TIMEOUT = seconds("FTCORE_JOIN_TIMEOUT", 5.0)
# Lighthouse: how long a job's first quorum waits, from the job's first message, for a group it
# expects that has not spoken yet (processes still starting, a pod still scheduled) before it
# starts without it (it joins later by heal). A short job could otherwise end before it starts.
START_TIMEOUT = seconds("FTCORE_START_TIMEOUT", 30.0)
# Bound on fetching a heal snapshot from a healthy peer.
HEAL_TIMEOUT = seconds("FTCORE_HEAL_TIMEOUT", 30.0)
# Bound on one small control-plane HTTP call (register, heartbeat, report).
RPC_TIMEOUT = seconds("FTCORE_RPC_TIMEOUT", 2.0)
# Control plane through trouble: while the lighthouse answers nothing (stopped, overloaded,
# cut off) for LIGHTHOUSE_SILENT, a group whose last step committed in an unchanged quorum
# goes on in that quorum for up to LEASE seconds after it asked the lighthouse for it
# (FTCORE_LEASE=0: never; every step waits for the lighthouse). The data plane still sees
# a crash at once; then the survivors wait for the lighthouse as before. Meanwhile the
# lighthouse forms no quorum without one of its members (a group that stood aside waits out
# the lease when they all hang at once): longer rides out longer outages, shorter bounds that wait.
LEASE = _lease()
LIGHTHOUSE_SILENT = seconds("FTCORE_LIGHTHOUSE_SILENT", 0.2)
# One collective inside a replica group (training's NCCL groups and their gloo twins): NCCL's
# watchdog ends a hung group after it, and ranks waiting at a barrier for rank 0 wait this long.
GROUP_COLLECTIVE_TIMEOUT = seconds("FTREC_COLLECTIVE_TIMEOUT_S", 300.0)
# A group that has not committed for this long gives up (its process exits non-zero and is
# restarted) instead of retrying forever.
STUCK_TIMEOUT = seconds("FTCORE_STUCK_TIMEOUT", 120.0)
# When the data is done, how long the groups wait for every group of the job to be back (one
# held out as slow is readmitted at once, a restarted one heals in) so that all end as one.
END_WAIT = seconds("FTCORE_END_WAIT", 30.0)
# A lighthouse whose own clock jumped by more than this was paused: before it judges any
# heartbeat timeout it waits one HEARTBEAT_TIMEOUT, so that nobody is declared dead for its pause.
PAUSE_JUMP = seconds("FTCORE_PAUSE_JUMP", 1.0)
# The launcher's lease on its run folder (ftcore/launcher/lease.py): its holder rewrites its
# heartbeat this often; a holder on another host whose heartbeat is older than RUN_LEASE_STALE
# is dead (its lock may not span hosts). Far above the heartbeat and any clock skew between hosts.
RUN_LEASE_HEARTBEAT = seconds("FTCORE_RUN_LEASE_HEARTBEAT", 5.0)
RUN_LEASE_STALE = seconds("FTCORE_RUN_LEASE_STALE", 60.0)

if not RUN_LEASE_HEARTBEAT < RUN_LEASE_STALE:
    raise SystemExit("ftcore: FTCORE_RUN_LEASE_HEARTBEAT must be below FTCORE_RUN_LEASE_STALE; fix them")
if not HEARTBEAT_INTERVAL < HEARTBEAT_TIMEOUT < COLLECTIVE_TIMEOUT <= QUORUM_TIMEOUT:
    raise SystemExit(
        "ftcore: timeouts must satisfy FTCORE_HEARTBEAT_INTERVAL < FTCORE_HEARTBEAT_TIMEOUT < "
        "FTCORE_COLLECTIVE_TIMEOUT <= FTCORE_QUORUM_TIMEOUT; fix those environment variables"
    )
