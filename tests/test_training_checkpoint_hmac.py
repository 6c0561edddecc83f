"""Keyed checkpoints (#41): meta.json is sealed with an HMAC-SHA256 under the deployment's key
(FTREC_CHECKPOINT_KEY_FILE) and lists every file's sha256. Every load path (resume, warm start,
the gate's challenger and champion, `training eval`) refuses a tampered file, a manifest
rewritten to match it (the unkeyed attack), a missing manifest, a checkpoint sealed under
another key or under none, and a process without a key; each refusal names the folder and file."""

import hashlib
import json
import os
import re
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import synthetic_shards

from training import checkpoint, checkpoint_key, evaluate, gate
from training.checkpoint import CheckpointError
from training.checkpoint_files import digest
from training.checkpoint_key import KEY_ENV
from training.config import load_config
from training.train import Trainer, train


def _cfg(shards: str, out, *extra: str):
    return load_config(
        None,
        [
            f"data.shards={shards}",
            f"train.out={out}",
            "train.max_steps=3",
            "mlflow.enabled=false",
            "eval.periodic=false",
            "model.dim=16",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> SimpleNamespace:
    d = tmp_path_factory.mktemp("hmac")
    shards = str(synthetic_shards(d, users=120, items=60, seed=3, world_size=1, batch_size=16, max_len=12))
    return SimpleNamespace(shards=shards, ckpt=train(_cfg(shards, d / "run"))["checkpoint"])


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def _rewrite_manifest(folder: Path) -> None:
    """The unkeyed attack: rewrite a file, then its sha256 in meta.json (the seal left as it was)."""
    _flip(folder / "state.pt")
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"]["state.pt"] = digest(str(folder / "state.pt"))
    (folder / "meta.json").write_text(json.dumps(meta))


def _unkeyed(folder: Path) -> None:
    """A checkpoint as written before keyed checkpoints: each file's sha256, no seal."""
    meta = json.loads((folder / "meta.json").read_text())
    del meta[checkpoint_key.SEAL]
    meta["files"] = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in meta["files"]}
    (folder / "meta.json").write_text(json.dumps(meta))


def _sealed_elsewhere(folder: Path, tmp_path: Path, monkeypatch) -> None:
    """The checkpoint sealed under another deployment's key (or an attacker's own)."""
    ours = checkpoint.key()
    with monkeypatch.context() as m:
        m.setenv(KEY_ENV, str(checkpoint_key.ensure_key_file(tmp_path / "other.key")))
        checkpoint.rekey(str(folder), old=ours)


CASES = {
    "tampered file": (lambda f, t, mp: _flip(f / "state.pt"), r"state\.pt does not match the sha256 its sealed meta"),
    "rewritten manifest": (lambda f, t, mp: _rewrite_manifest(f), r"meta\.json: its HMAC does not verify under"),
    "missing manifest": (lambda f, t, mp: os.remove(f / "meta.json"), r"no meta\.json, so nothing vouches for"),
    "wrong key": (_sealed_elsewhere, r"meta\.json is sealed under another key \(id \w+\) than FTREC_CHECKPOINT_KEY"),
    "no seal": (lambda f, t, mp: _unkeyed(f), r"predates keyed checkpoints.*python -m training\.checkpoint rekey"),
    "no key": (lambda f, t, mp: mp.delenv(KEY_ENV), r"no checkpoint key: .*set FTREC_CHECKPOINT_KEY_FILE"),
}


def _trainer(cfg, capsys) -> str | None:
    """A Trainer's set-up: why it refused, or None when it took the checkpoint."""
    try:
        tr = Trainer(cfg)
    except CheckpointError as e:
        return str(e)
    if tr.state.step > 0 or cfg.train.init_checkpoint:
        return None
    said = capsys.readouterr()
    return said.out + said.err  # resume skipped every checkpoint: each one said, with why


def _resume(w, folder: Path, capsys) -> str | None:
    return _trainer(_cfg(w.shards, folder.parent.parent, "train.resume=true"), capsys)


def _warm_start(w, folder: Path, capsys) -> str | None:
    return _trainer(_cfg(w.shards, folder.parents[2] / "next", f"train.init_checkpoint={folder}"), capsys)


def _raises(fn, *args) -> str | None:
    try:
        fn(*args)
    except CheckpointError as e:
        return str(e)
    return None


def _gate_challenger(w, folder: Path, capsys) -> str | None:
    return _raises(gate.judge, w.shards, str(folder), None)


def _gate_champion(w, folder: Path, capsys) -> str | None:
    try:
        verdict = gate.judge(w.shards, w.ckpt, str(folder))
    except CheckpointError as e:  # no key at all: the challenger is refused first
        return str(e)
    assert (verdict["champion"] is None) == (verdict["champion_error"] is not None)
    return verdict["champion_error"]  # a champion that cannot be scored: the gate keeps it


def _eval(w, folder: Path, capsys) -> str | None:
    return _raises(evaluate.evaluate_checkpoint, str(folder), w.shards)


PATHS = {
    "resume": _resume,
    "warm start": _warm_start,
    "gate challenger": _gate_challenger,
    "gate champion": _gate_champion,
    "eval": _eval,
}


def _copy(w, tmp_path: Path) -> Path:
    folder = tmp_path / "run" / "checkpoints" / os.path.basename(w.ckpt)
    shutil.copytree(w.ckpt, folder)
    return folder


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", list(PATHS))
def test_every_load_path_refuses_it_by_folder_and_file(world, tmp_path, monkeypatch, capsys, path, case):
    folder = _copy(world, tmp_path)
    spoil, expected = CASES[case]
    spoil(folder, tmp_path, monkeypatch)
    capsys.readouterr()
    said = PATHS[path](world, folder, capsys)
    assert said is not None, f"{path} loaded a checkpoint with a {case}"
    assert re.search(expected, said, re.S), said
    if case != "no key":
        assert str(folder) in said, said


@pytest.mark.parametrize("path", list(PATHS))
def test_a_sealed_checkpoint_loads_on_every_path(world, tmp_path, capsys, path):
    assert PATHS[path](world, _copy(world, tmp_path), capsys) is None


def _group_checkpoint(folder: Path) -> None:
    """A 2-rank group's checkpoint as save() leaves it: state.pt, rank 1's file, sealed meta.json."""
    folder.mkdir(parents=True)
    torch.save({"model": {"w": torch.ones(8)}, "rng": torch.zeros(2)}, folder / "state.pt")
    torch.save({"rng": torch.full((2,), 7.0)}, folder / "rng-rank-00001.pt")
    (folder / "meta.json").write_text('{"step": 1}')
    checkpoint.rekey(str(folder))


def test_every_ranks_file_is_vouched_for(tmp_path):
    folder = tmp_path / "step-00000001"
    _group_checkpoint(folder)
    assert torch.equal(checkpoint.load(str(folder), rank=1)["rng"], torch.full((2,), 7.0))
    _flip(folder / "rng-rank-00001.pt")
    with pytest.raises(
        CheckpointError, match=r"step-00000001: rng-rank-00001\.pt does not match the sha256 its sealed"
    ):
        checkpoint.load(str(folder), rank=1)
    with pytest.raises(CheckpointError, match="rng-rank-00001.pt does not match"):
        checkpoint.verify(str(folder))
    shutil.copy(folder / "state.pt", folder / "rng-rank-00002.pt")  # a file the manifest never listed
    with pytest.raises(CheckpointError, match=r"rng-rank-00002\.pt is not in its sealed meta\.json"):
        checkpoint.load(str(folder), rank=2)


def test_a_file_is_checked_piece_by_piece_as_torch_reads_it(tmp_path, monkeypatch):
    """Pieces of 4 KiB: torch gets only bytes from pieces whose sha256 matched, one piece held
    at a time; a piece changed on disk after the check is never served, one not yet read is
    refused when torch reaches it (inside torch.load: the refusal still names the file)."""
    from training import checkpoint_files

    monkeypatch.setattr(checkpoint_files, "PIECE", 4096)
    w = torch.arange(50_000, dtype=torch.float32)
    folder = checkpoint.save(str(tmp_path / "ck"), {"model": {"w": w}, "rng": torch.zeros(2)}, {"step": 1})
    entry = checkpoint.read_meta(folder)["files"]["state.pt"]
    assert entry["piece"] == 4096 and len(entry["sha256"]) == -(-os.path.getsize(Path(folder) / "state.pt") // 4096)
    assert torch.equal(checkpoint.load(folder)["model"]["w"], w)
    with checkpoint_files.VerifiedFile(folder, "state.pt", entry) as f:
        first = f.read(100)
        raw = bytearray((Path(folder) / "state.pt").read_bytes())
        raw[10] ^= 1  # in the piece already checked and held
        raw[len(raw) // 2] ^= 1  # in a piece not read yet
        (Path(folder) / "state.pt").write_bytes(bytes(raw))
        f.seek(0)
        assert f.read(100) == first  # the checked bytes, not the file's new ones
        f.seek(len(raw) // 2)
        with pytest.raises(CheckpointError, match=r"state\.pt does not match the sha256"):
            f.read(10)
    raw[10] ^= 1  # only the piece in the middle differs now: refused from inside torch's reader
    (Path(folder) / "state.pt").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"step-00000001: state\.pt does not match the sha256 its sealed meta"):
        checkpoint.load(folder)


def test_rekey_vouches_for_an_old_checkpoint_it_checks_first_and_rotates_keys(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "step-00000001"
    _group_checkpoint(folder)
    _unkeyed(folder)
    with pytest.raises(checkpoint.CheckpointKeyError, match="predates keyed checkpoints"):
        checkpoint.load(str(folder))
    _flip(folder / "rng-rank-00001.pt")  # damaged before it was re-keyed: rekey refuses to vouch for it
    with pytest.raises(CheckpointError, match="rng-rank-00001.pt is missing or does not match the sha256 it"):
        checkpoint.rekey(str(folder))
    _flip(folder / "rng-rank-00001.pt")
    assert "2 file(s) checked" in checkpoint.rekey(str(folder))
    checkpoint.load(str(folder), rank=1)
    old = os.environ[KEY_ENV]
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "new.key"))
    assert checkpoint.main(["new-key", str(tmp_path / "new.key")]) == 0
    assert checkpoint.main(["rekey", str(folder)]) == 2  # sealed under the old key: says so
    assert "sealed under another key" in capsys.readouterr().err
    assert checkpoint.main(["rekey", str(folder), "--from-key-file", old]) == 0
    assert checkpoint.load(str(folder), rank=1)["rng"].sum() == 14
    monkeypatch.setenv(KEY_ENV, old)
    with pytest.raises(checkpoint.CheckpointKeyError, match="sealed under another key"):
        checkpoint.load(str(folder))


def test_resume_stops_on_a_key_problem_rather_than_starting_over(tmp_path):
    """A tampered checkpoint is skipped for an older one; one sealed under another key is not:
    every checkpoint would be refused alike, and a run started over would hide that."""
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        checkpoint.save(str(root), {"model": {"w": torch.zeros(4)}, "rng": torch.zeros(2)}, {"step": step})
    _flip(root / "step-00000002" / "state.pt")
    said: list[str] = []
    assert checkpoint.latest_verified(str(root), said.append) == str(root / "step-00000001")
    assert "step-00000002: state.pt does not match" in said[0]
    _unkeyed(root / "step-00000001")
    with pytest.raises(checkpoint.CheckpointKeyError, match="step-00000001: meta.json carries no HMAC"):
        checkpoint.latest_verified(str(root), said.append)


def test_the_key_file(tmp_path, monkeypatch, capsys):
    """Made once, private from its first byte, never replaced; a group-readable one is said
    (once), a short one refused; without the setting nothing is written or read."""
    path = tmp_path / "k" / "checkpoint.key"
    assert checkpoint.main(["new-key", str(path)]) == 0
    secret = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(secret.strip()) >= 40
    assert checkpoint.main(["new-key", str(path)]) == 0 and path.read_text() == secret
    assert "exists, kept" in capsys.readouterr().out
    path.chmod(0o644)
    monkeypatch.setenv(KEY_ENV, str(path))
    checkpoint.key(), checkpoint.key()
    assert capsys.readouterr().err.count("is readable by its group or others (mode 644); chmod 600") == 1
    short = tmp_path / "short.key"
    short.write_text("123456")
    monkeypatch.setenv(KEY_ENV, str(short))
    with pytest.raises(checkpoint.CheckpointKeyError, match="holds 6 characters"):
        checkpoint.key()
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(checkpoint.CheckpointKeyError, match="no checkpoint key"):
        checkpoint.save(str(tmp_path / "ck"), {"rng": torch.zeros(1)}, {"step": 1})
    assert not (tmp_path / "ck").exists()


def test_make_run_and_the_launcher_make_a_key_once_unless_one_is_set(tmp_path, monkeypatch):
    from ftrec_airflow import local_run
    from training import launch

    monkeypatch.delenv(KEY_ENV)
    work = tmp_path / "work"
    env = local_run.airflow_env(work)
    assert env[KEY_ENV] == str(work / "checkpoint.key") and stat.S_IMODE(os.stat(env[KEY_ENV]).st_mode) == 0o600
    secret = Path(env[KEY_ENV]).read_text()
    assert local_run.airflow_env(work)[KEY_ENV] == env[KEY_ENV] and Path(env[KEY_ENV]).read_text() == secret
    launch._checkpoint_key(str(tmp_path / "launch"))  # the local launcher's ranks inherit it
    assert os.environ[KEY_ENV] == str(tmp_path / "launch" / "checkpoint.key")
    assert KEY_ENV not in local_run.airflow_env(work)  # a deployment's own key wins


def test_the_printed_torchrun_commands_carry_the_key_file(tmp_path, monkeypatch, capsys):
    """A rank started from `launch --print-commands` on another host seals with the launch's key."""
    import shlex

    from training import launch

    key = checkpoint_key.ensure_key_file(tmp_path / "deploy.key")
    monkeypatch.setenv(KEY_ENV, str(key))
    shards = synthetic_shards(tmp_path, users=40, items=30, seed=1, world_size=2, batch_size=4, max_len=8)
    argv = ["--shards", str(shards), "--out", str(tmp_path / "run"), "--replica-groups", "2"]
    assert launch.main([*argv, "--print-commands"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        words = shlex.split(line)
        env = dict(w.split("=", 1) for w in words[: words.index("torchrun")])
        assert env[KEY_ENV] == str(key) and env["FTREC_REPLICA_GROUP"] in {"0", "1"}
