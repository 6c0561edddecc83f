"""ftcore: FT-HSDP fault-tolerant runtime (lighthouse, FTAR, commit vote, catch-up).

Depends on torch and the standard library only; never on training, dataprep or Airflow.

The replica group (K ranks) is the unit of failure; one failed group restarts alone
while the others keep training, and the returning group catches up from a healthy one.

    lighthouse.py         the standing control plane: jobs born and retired, pauses, the CLI
                          (`ftcore-lighthouse`)
    lighthouse_job.py     one job: membership, health, quorum rounds, heal assignments, events
    quorum.py             the quorum decision and plan, as pure functions
    lighthouse_http.py    its HTTP/1.1 front end (llhttp, one asyncio loop, every step bounded)
    lighthouse_page.py    its HTML page (GET /)
    lighthouse_client.py  a rank's heartbeats, quorum requests and failure reports
    messages.py           every lighthouse message as one typed definition, parsed and checked once
    pace.py               fail-slow: a group much slower than its peers waits on standby
    manager.py            the per-rank step protocol: start_quorum / allreduce / should_commit
    ftar.py               the fault-tolerant all-reduce across groups (gloo; CUDA gradients host-staged)
    collectives.py        the one device rule: data on the group's device, control values on a gloo twin
    heal.py               non-blocking catch-up: background snapshot server and fetch
    tensorfile.py         tensor-only serialization (safetensors layout, stdlib + torch)
    final_state.py        a group's final-state file: its name, checksum and header (stdlib only)
    schedule.py           exactly-once data: the replicated schedule with make-up steps
    ledger.py             the ledger of committed batches and the exactly-once check
    faults.py             fault plans (tests, benchmarks, launcher, chaos DAG)
    timeouts.py           every timeout, with its environment override
    auth.py               the admin secret and the per-job tokens derived from it
    fsutil.py             the atomic file write (token file, tensor files; ftcore's own, stdlib only)
    netaddr.py            the one address a rank binds and advertises (FTCORE_HOST or derived)
    examples/toy.py       a self-contained trainer on all of the above

Measured by benchmarks/ftcore_bench.py; the scale model is benchmarks/sim (outside the package).

Failure handling, in the order things happen after a `kill -9` of one group:

1. the survivors' FTAR raises within milliseconds (the peer's sockets reset); they
   report to the lighthouse, which has also seen the dead rank's heartbeat connection
   close; the step is discarded (nothing applied) and retried with the same batch;
2. the next quorum round forms at once without the dead group (a new quorum_id, so a
   new gloo group on a fresh store prefix); the survivors commit, with the learning
   rate scaled by the LR policy (sqrt(live/total) by default);
3. the launcher hands the group to a warm spare process; it registers, joins the next
   round, is told to heal from a healthy group, fetches that group's snapshot of step n
   (taken before n's optimizer step) in the background, contributes zeros to step n's
   FTAR, loads the snapshot, applies the same averaged update and is bitwise identical.

A silent lighthouse does not stop training: a group whose quorum is unchanged goes on in
it for a bounded lease (manager.py), and a lighthouse that was paused grants a grace period
before it judges anyone's silence (lighthouse.py).

A hang (SIGSTOP) is found by the heartbeat timeout instead; the survivors' waiting
FTAR notices the lighthouse's verdict and gives up at once. A group left out of a
quorum may have committed a step the others discarded (it got the last bytes of an
all-reduce they gave up on), so the lighthouse only takes heal sources from the
previous quorum's members and always heals a returning group, even at an equal step.
"""
