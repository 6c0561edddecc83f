"""Faults that close no connection, on simulated hosts: the lighthouse's host cut off the network.

Four network namespaces on one switch: the lighthouse on host a, three single-rank replica groups
of the toy trainer (ftcore/examples/toy.py) on b, c and d. Mid-run, a's port on the switch goes
down for several heartbeat timeouts (packets vanish, no socket closes), then comes back.
The lighthouse must take the silence as its own isolation: nobody declared failed, nobody healed,
the groups go on under their lease, every group ends with the same state, every batch once."""

import json
import os
import sys
import time
from pathlib import Path

import netns
import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.integ
STEPS = 300


def _records(out: Path, g: int) -> list[dict]:
    recs = []
    for f in sorted((out / "records").glob(f"group-{g}-rank-0-inc-*.jsonl")):
        recs += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return recs


def _events(out: Path) -> list[dict]:
    path = out / "lighthouse-events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait(cond, timeout: float, what: str, logs: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            tails = {f.name: f.read_text()[-1500:] for f in logs.glob("*.log")}
            raise AssertionError(f"timed out waiting for {what}: {tails}")
        time.sleep(0.1)


def test_a_lighthouse_cut_off_the_network_fails_nobody_and_heals_nobody(tmp_path):
    why = netns.unavailable()
    if why:
        pytest.skip(f"simulated hosts unavailable: {why}")
    out, logs = tmp_path / "run", tmp_path / "logs"
    out.mkdir()
    logs.mkdir()
    token = tmp_path / "token"
    token.write_text("partition-test-secret")
    token.chmod(0o600)
    with netns.Hosts(["a", "b", "c", "d"]) as hosts:
        lighthouse = f"{hosts.addr['a']}:29510"
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "FTCORE_LIGHTHOUSE": lighthouse,
            "FTCORE_TOKEN_FILE": str(token),  # the admin secret: each rank derives its job's token
            "FTCORE_JOB_ID": "partition",
            "FTREC_NUM_REPLICA_GROUPS": "3",
            "FTCORE_INCARNATION": "0",
        }
        env.pop("FTCORE_HOST", None)
        argv = [sys.executable, "-m", "ftcore.lighthouse", "--bind", lighthouse, "--token-file", str(token)]
        hosts.start("a", [*argv, "--events-file", str(out / "lighthouse-events.jsonl")], env, logs / "a.log")
        toys = {
            h: hosts.start(
                h,
                [sys.executable, "-m", "ftcore.examples.toy", "--out", str(out), "--steps", str(STEPS)]
                + ["--step-sleep", "0.03"],
                {**env, "FTREC_REPLICA_GROUP": str(g)},
                logs / f"{h}.log",
            )
            for g, h in enumerate("bcd")
        }
        _wait(lambda: all(len(_records(out, g)) >= 20 for g in range(3)), 180, "every group to train", logs)
        hosts.cut("a")  # the lighthouse's host drops off the network; its process runs on
        time.sleep(8.0)  # four heartbeat timeouts (2 s), within the lease (10 s)
        hosts.cut("a", off=False)
        for h, p in toys.items():
            assert p.wait(timeout=240) == 0, (h, (logs / f"{h}.log").read_text()[-2000:])

    events = _events(out)
    kinds = [e["kind"] for e in events]
    assert "lighthouse_isolated" in kinds, kinds  # it noticed that it heard nobody ...
    assert "failure_detected" not in kinds and "heal_assigned" not in kinds, kinds  # ... and blamed nobody
    sums = set()
    for h in "bcd":
        log = (logs / f"{h}.log").read_text()
        sums |= {line.split("checksum ")[1].split()[0] for line in log.splitlines() if " checksum " in line}
    assert len(sums) == 1, sums  # every group ends with the same state
    for g in range(3):
        recs = _records(out, g)
        assert sum(r["committed"] for r in recs) == STEPS  # every batch once, none twice
        assert any(r["committed"] and r["leased"] for r in recs)  # it went on without the lighthouse
