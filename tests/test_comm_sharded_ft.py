"""The sharded item table (comm.embedding=sharded) under FT-HSDP: 2 replica groups x 2 ranks.

Rank k of every replica group holds the same rows of the table, so FTAR averages shard k
with shard k, and a recovering group heals rank by rank from the same rank of a healthy
group (ftcore/manager.py). Each rank writes its own final state file (training/replica.py
`finish(per_rank=True)`) and the launcher's checksum covers them all.

- no fault: the sharded run's full table (shards concatenated from the per-rank files) and
  every other parameter and the table's optimizer state are bitwise equal to the replicated
  run's (dropout 0, clipping 0: with 2 ranks every float addition of the sharded table
  happens in the replicated order, tests/test_comm_sharded_training.py; FTAR averages
  elementwise), and both groups end identical on every rank;
- kill -9 of one group mid-run: it restarts, heals shard by shard, both groups end
  identical on every rank, and the ledger shows every sample trained exactly once.

Every process runs in its own session and is ended by its process group.
"""

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import helped_pieces, run_launch, shard_sample_ids, synthetic_shards

from dataprep import schema
from ftcore import ledger, tensorfile
from training import checkpoint
from training.launch import TOY, TrainerLaunchConfig, TrainerLauncher

ROOT = Path(__file__).resolve().parent.parent
ITEMS = 90  # 91 rows with padding: shards of 46 and 45 rows (a mix-up cannot load)
EPOCHS = 2
SETTINGS = [
    "loss.kind=sampled_softmax",  # one loss for both tables (auto: softmax on a replicated one only)
    f"train.epochs={EPOCHS}",
    "model.dropout=0",
    "optim.grad_clip=0",
    "model.dim=16",
    "optim.warmup_steps=2",
    "train.log_every=1",
    "mlflow.enabled=false",
    "eval.periodic=false",
    "eval.final=false",
]


def launch(
    shards: Path,
    out: Path,
    extra: list[str],
    plan: list[dict] | None = None,
    spares: bool = True,
    timeout: float = 200.0,
) -> str:
    """`python -m training launch` with 2 groups x 2 ranks; returns its log (asserts exit 0)."""
    flags = [] if spares else ["--no-spares"]  # no restart expected: save the 2 cores 4 warm processes
    r = run_launch(
        out,
        timeout,
        shards=shards,
        groups=2,
        ranks=2,
        faults=plan or None,
        timeout=timeout - 20,
        flags=flags,
        worker_args=["--set", *SETTINGS, *extra],
    )
    (out.parent / f"{out.name}.log").write_text(r.stdout)  # the whole story, for a failure's post-mortem
    assert r.returncode == 0, r.stdout[-5000:]
    return r.stdout


def rank_files(out: Path, g: int) -> list[Path]:
    return [out / f"replica_{g}" / "state.safetensors", out / f"replica_{g}" / "state.rank1.safetensors"]


def assert_groups_identical(out: Path, log: str) -> list[dict]:
    """Both groups' rank files bitwise equal, the launcher's checksum over both files equal;
    returns group 0's per-rank states."""
    a, b = rank_files(out, 0), rank_files(out, 1)
    for k in range(2):
        assert a[k].read_bytes() == b[k].read_bytes(), f"rank {k}: the groups ended with different states"
    sums = json.loads((out / "timeline.json").read_text())["checksums"]
    both = hashlib.sha256(a[0].read_bytes() + a[1].read_bytes()).hexdigest()[:16]
    assert sums == {"0": both, "1": both}, "the launcher's checksum does not cover every rank's file"
    assert "different states" not in log
    states = [tensorfile.load(str(p)) for p in a]
    assert [s["model"]["item_emb.weight"].shape[0] for s in states] == [46, 45]  # each rank its own rows
    return states


def losses(log: str) -> list[tuple[str, str, str]]:
    return sorted(re.findall(r"\[train g(\d)\] step (\d+)/\d+ epoch \d+ loss (\S+)", log))


def table_param(state: dict) -> int:
    return next(g for g in state["optimizer"]["param_groups"] if g["name"] == "embedding")["params"][0]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return synthetic_shards(
        tmp_path_factory.mktemp("sharded_ft"), users=300, items=ITEMS, seed=5, world_size=4, batch_size=8, max_len=20
    )


@pytest.mark.integ
@pytest.mark.slow
def test_sharded_table_two_groups_bitwise_equal_to_replicated(shards, tmp_path):
    shd = launch(shards, tmp_path / "shd", ["comm.embedding=sharded"], spares=False)
    rep = launch(shards, tmp_path / "rep", [], spares=False)
    assert "item table sharded row-wise over 2 ranks" in shd and "item table sharded" not in rep
    s0, s1 = assert_groups_identical(tmp_path / "shd", shd)
    # the replicated run: one state file per group (its ranks are identical), equal across groups
    r0, r1 = rank_files(tmp_path / "rep", 0)[0], rank_files(tmp_path / "rep", 1)[0]
    assert r0.read_bytes() == r1.read_bytes()
    assert not rank_files(tmp_path / "rep", 0)[1].exists()
    rep_state = tensorfile.load(str(r0))

    assert len(losses(rep)) == 2 * EPOCHS * int(json.loads((shards / schema.MANIFEST).read_text())["steps"])
    assert losses(shd) == losses(rep)
    full = torch.cat([s0["model"]["item_emb.weight"], s1["model"]["item_emb.weight"]])
    assert torch.equal(full, rep_state["model"]["item_emb.weight"]), "full sharded table != replicated table"
    for name, w in rep_state["model"].items():
        if name != "item_emb.weight":
            assert torch.equal(w, s0["model"][name]) and torch.equal(w, s1["model"][name]), name
    # the table's Adam moments, shard by shard, are the replicated table's too
    i = table_param(rep_state)
    assert table_param(s0) == table_param(s1) == i
    for key in ("exp_avg", "exp_avg_sq", "step"):
        mine = [s["optimizer"]["state"][i][key] for s in (s0, s1)]
        want = rep_state["optimizer"]["state"][i][key]
        got = mine[0] if key == "step" else torch.cat(mine)
        assert torch.equal(got, want), key
    # the final checkpoint holds the full table (gathered), the same one
    ckpt = json.loads((tmp_path / "shd" / "replica_1" / "result.json").read_text())["checkpoint"]
    assert torch.equal(checkpoint.load(ckpt)["model"]["item_emb.weight"], full)


@pytest.mark.integ
@pytest.mark.slow
def test_sharded_table_kill9_group_heals_shard_by_shard_exactly_once(shards, tmp_path):
    out = tmp_path / "run"
    steps = int(json.loads((shards / schema.MANIFEST).read_text())["steps"])
    log = launch(
        shards, out, ["comm.embedding=sharded"], plan=[{"kind": "kill", "group": 1, "rank": "all", "at_step": 6}]
    )
    tl = json.loads((out / "timeline.json").read_text())
    assert tl["restarts"] == {"0": 0, "1": 1}
    assert any(e["kind"] == "fault" and e.get("group") == 1 for e in tl["launcher_events"])
    # both ranks of the restarted group loaded a peer's state: rank k's from rank k (a mix-up
    # would not load, the shards have different sizes, and would not end identical below)
    healed = {e["rank"] for e in tl["lighthouse_events"] if e["kind"] == "heal_finished" and e["group"] == 1}
    assert healed == {0, 1}
    assert_groups_identical(out, log)

    sample_ids = shard_sample_ids(shards)

    summary = ledger.check(
        str(out / "ledger"),
        steps_per_epoch=steps,
        num_groups=2,
        ranks_per_group=2,
        epochs=EPOCHS,
        sample_ids=sample_ids,
    )
    assert summary["batches"] == 2 * 2 * EPOCHS * steps
    assert summary["makeup_steps"] >= 1, "the killed group missed no step: the make-up path was not exercised"
    # spread: the survivor trained some of the killed group's missed batches from its shards
    helped = helped_pieces(out / "ledger")
    assert helped, "every missed batch was made up by its owner alone"


def _state(path: Path, tensor: torch.Tensor, **meta: str) -> None:
    tensorfile.save({"model": {"w": tensor}}, str(path), {"step": "3", **meta})


def test_launcher_checksum_covers_every_announced_rank_file(tmp_path, capsys):
    """TrainerLauncher.report on real files: shard files count, stale or missing ones are handled."""
    out = tmp_path / "launch"
    launcher = TrainerLauncher(TrainerLaunchConfig(out=str(out), replica_groups=2, ranks_per_group=2, worker=TOY))
    for g in range(2):
        (out / f"replica_{g}").mkdir()
    # single-file groups: the checksum is the file's sha256, as before
    for g in range(2):
        _state(rank_files(out, g)[0], torch.arange(4.0))
    single = launcher.report()
    raw = rank_files(out, 0)[0].read_bytes()
    assert single == {0: hashlib.sha256(raw).hexdigest()[:16], 1: hashlib.sha256(raw).hexdigest()[:16]}
    # a stale rank file that rank 0 does not announce is not part of the state
    _state(rank_files(out, 1)[1], torch.ones(2))
    assert launcher.report() == single
    # per-rank groups whose rank 0 files agree but whose shards 1 differ: different states
    for g in range(2):
        _state(rank_files(out, g)[0], torch.arange(4.0), rank="0", ranks="2")
        _state(rank_files(out, g)[1], torch.full((2,), float(g)), rank="1", ranks="2")
    capsys.readouterr()
    sums = launcher.report()
    assert rank_files(out, 0)[0].read_bytes() == rank_files(out, 1)[0].read_bytes()
    assert sums[0] != sums[1] and "WARNING: replica groups ended with different states" in capsys.readouterr().out
    a = rank_files(out, 0)
    assert sums[0] == hashlib.sha256(a[0].read_bytes() + a[1].read_bytes()).hexdigest()[:16]
    # an announced rank file left from another run (another step): no checksum for that group
    _state(rank_files(out, 1)[1], torch.full((2,), 1.0), rank="1", ranks="2", step="2")
    assert set(launcher.report()) == {0}
    assert "state.rank1.safetensors is from another step" in capsys.readouterr().out
    # an announced rank file that is missing: no checksum for that group (the run then fails)
    rank_files(out, 1)[1].unlink()
    assert set(launcher.report()) == {0}
    assert "replica_1: final state incomplete, 1 of 2 rank file(s) missing" in capsys.readouterr().out
