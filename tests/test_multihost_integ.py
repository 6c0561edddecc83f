"""Four hosts, one standing lighthouse, replica groups as plain torchrun jobs; one host lost.

Hosts are network namespaces (tests/netns.py): each has its own 127.0.0.1, so anything that
assumes one host (a loopback address advertised to a peer, a store on the wrong interface)
fails here as it would across machines.

    host a: the lighthouse (`python -m ftcore.lighthouse`, token file)
    host b: replica group 0, one torchrun job, 1 node x 2 ranks
    hosts c, d: replica group 1, one torchrun job over 2 nodes x 1 rank (rendezvous on c)

Mid-run every process of host d is killed with SIGKILL. Group 0 keeps committing alone;
group 1's rank on c learns from the lighthouse that its group lost a rank and exits, so its
torchrun job fails; the test, as a cluster scheduler does with a failed multi-node job,
starts the whole group again on c and d (a new rendezvous); group 1 heals from group 0
across hosts and both finish with bitwise-identical states, every sample trained once.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import netns
import pytest
from conftest import cli_shard_set, shard_sample_ids

from dataprep import schema
from ftcore import ledger

pytestmark = [pytest.mark.integ, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
RUN_TIMEOUT = 420
EPOCHS = 40
WILDCARDS = ("*:", "0.0.0.0:", "[::]:")


def _committed(out: Path, g: int) -> list[dict]:
    recs = []
    for f in (out / f"replica_{g}" / "records").glob("rank-0-*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if r["committed"]:
                recs.append(r)
    return recs


def _wait(pred, timeout: float, what: str, logs: Path) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(logs.glob("*.log")))
            pytest.fail(f"timed out after {timeout}s waiting for {what}\n{tails}")
        time.sleep(0.2)


def test_a_lost_host_is_restarted_by_its_scheduler_and_heals_across_hosts(tmp_path):
    why = netns.unavailable()
    if why:
        pytest.skip(f"simulated hosts unavailable: {why}")
    shards = cli_shard_set(tmp_path, world_size=4, users=2400)
    steps = json.loads((shards / schema.MANIFEST).read_text())["steps"]
    out, logs = tmp_path / "run", tmp_path / "logs"
    out.mkdir()
    logs.mkdir()
    token = tmp_path / "token"
    token.write_text("netns-test-token")
    token.chmod(0o600)
    with netns.Hosts(["a", "b", "c", "d"]) as hosts:
        addr = hosts.addr
        lighthouse = f"{addr['a']}:29510"
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "FTCORE_LIGHTHOUSE": lighthouse,
            "FTCORE_TOKEN_FILE": str(token),
            "FTCORE_JOB_ID": "netns",
            "FTREC_NUM_REPLICA_GROUPS": "2",
        }
        env.pop("FTCORE_HOST", None)  # each rank derives its address from the route to the lighthouse
        hosts.start(
            "a",
            [
                sys.executable,
                "-m",
                "ftcore.lighthouse",
                "--bind",
                lighthouse,
                "--token-file",
                str(token),
                "--events-file",
                str(out / "lighthouse-events.jsonl"),
            ],
            env,
            logs / "a.log",
        )

        def group(g: int, host: str, nnodes: int, nproc: int, rdzv_host: str, attempt: int = 0):
            argv = [
                TORCHRUN,
                "--nnodes",
                str(nnodes),
                "--nproc-per-node",
                str(nproc),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"{addr[rdzv_host]}:29400",
                "--rdzv-id",
                f"netns-g{g}-{attempt}",
                "--max-restarts",
                "3" if nnodes == 1 else "0",
                "--tee",
                "3",
                "--local-addr",
                addr[host],
                *(["--rdzv-conf", "is_host=1"] if host == rdzv_host else []),
                "-m",
                "training",
                "train",
                "--shards",
                str(shards),
                "--out",
                str(out / f"replica_{g}"),
                "--set",
                f"train.epochs={EPOCHS}",
                "model.dim=16",
                "loss.kind=sampled_softmax",
                "loss.num_negatives=16",
                "mlflow.enabled=false",
                "eval.periodic=false",
                "eval.batch_size=256",
            ]
            return hosts.start(host, argv, {**env, "FTREC_REPLICA_GROUP": str(g)}, logs / f"{host}{attempt}.log")

        agents = {"b": group(0, "b", 1, 2, "b"), "c": group(1, "c", 2, 1, "c"), "d": group(1, "d", 2, 1, "c")}
        _wait(lambda: len(_committed(out, 1)) >= 5, 240, "group 1 to commit 5 steps", logs)

        # nothing of ftcore or the trainer listens on a wildcard address or on another host's
        for h in ("b", "c", "d"):
            workers = [(a, pid) for a, pid in hosts.listening(h) if pid != agents[h].pid]  # torchrun's own: README
            assert workers, f"no trainer sockets found on host {h}"
            assert not [a for a, _ in workers if a.startswith(WILDCARDS)], (h, workers)
            assert all(a.startswith(f"{addr[h]}:") for a, _ in workers), (h, workers)
        assert [a for a, _ in hosts.listening("a")] == [lighthouse]

        killed = hosts.kill_host("d")
        assert agents["d"].pid in killed
        before = len(_committed(out, 0))
        # group 0 goes on alone: its commits in a quorum of one
        _wait(
            lambda: sum(r["participants"] == 1 for r in _committed(out, 0)) >= 3, 120, "group 0 to commit alone", logs
        )
        assert len(_committed(out, 0)) > before
        # c's rank fails at once: its group's collective breaks, or the lighthouse says its group lost a rank
        code = agents["c"].wait(timeout=60)
        assert code != 0, "group 1's torchrun on c should fail when its other node is lost"
        # the scheduler restarts the failed job on its nodes, a replacement machine for d
        agents["c"], agents["d"] = group(1, "c", 2, 1, "c", attempt=1), group(1, "d", 2, 1, "c", attempt=1)

        deadline = time.monotonic() + RUN_TIMEOUT
        codes = {}
        for h, p in agents.items():
            try:
                codes[h] = p.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[h] = None
        assert set(codes.values()) == {0}, f"torchrun exit codes {codes}\n" + "\n".join(
            f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(logs.glob("*.log"))
        )

    s0 = (out / "replica_0" / "state.safetensors").read_bytes()
    s1 = (out / "replica_1" / "state.safetensors").read_bytes()
    assert s0 == s1, "the group that lost a host ended with a different state"
    events = [json.loads(x) for x in (out / "lighthouse-events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "heal_finished" and e.get("group") == 1 for e in events)
    assert all(e.get("job", "netns") == "netns" for e in events)
    summary = ledger.check(
        str(out / "ledger"),
        steps_per_epoch=steps,
        num_groups=2,
        ranks_per_group=2,
        epochs=EPOCHS,
        sample_ids=shard_sample_ids(shards),
    )
    assert summary["batches"] == EPOCHS * 2 * steps * 2  # every (group, rank) records its batches
    assert not [n for n in os.listdir("/var/run/netns") if n.startswith(f"ft{hosts.tag}")]
