"""Atomic, keyed checkpoints of `TrainState`, loaded without executing code.

OUT/checkpoints/step-N/ holds state.pt, rng-rank-K.pt (the group's other ranks) and
meta.json (step, config, fingerprint, topology, every file's size and pieces' sha256), sealed
with an HMAC-SHA256 under the deployment's key (training/checkpoint_key.py). The ranks write
into a .tmp folder that rank 0 renames into place after a barrier: a crash leaves a complete
checkpoint or a .tmp that nothing reads. Every read verifies meta.json's HMAC first; a file is
unpickled (weights_only) only from pieces whose sha256 matched (training/checkpoint_files.py);
`latest_verified` is the newest checkpoint that verifies.

    python -m training.checkpoint new-key FILE | rekey FOLDER... [--from-key-file OLD]
"""

import argparse
import json
import os
import re
import shutil
import sys
from typing import IO, cast

import torch
import torch.distributed as dist

from ftcore import collectives as coll
from ftcore.util.files import atomic_write_json, sha256_file
from training.checkpoint_files import VerifiedFile, digest
from training.checkpoint_key import (
    KEY_ENV,
    SEAL,
    CheckpointError,
    CheckpointKeyError,
    Key,
    ensure_key_file,
    key,
    key_from_file,
    seal,
    unseal,
)

STEP_DIR = re.compile(r"^step-(\d{8})$")
META = "meta.json"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def _save_durable(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def save(
    root: str,
    state: dict,
    meta: dict,
    rank: int = 0,
    keep: int = 2,
    per_rank: tuple = ("rng",),
    distributed: bool = True,
) -> str:
    """Write `state` for step meta["step"] under root; returns the final folder.

    Collective when torch.distributed is initialized (every rank of the group calls it),
    unless `distributed=False` (rank 0 alone writes, e.g. a weights-only checkpoint).
    Only rank 0's state carries model/optimizer (replicas are identical); other ranks
    contribute their RNG states (and the keys in `per_rank`: a sharded table's optimizer state).
    Every rank needs the key (CheckpointKeyError before anything is written, on every rank alike).
    """
    sealer = key()
    final = step_dir(root, int(meta["step"]))
    tmp = final + ".tmp"
    collective = distributed and _distributed()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if collective:
        coll.barrier()
    if rank == 0:
        _save_durable(state, os.path.join(tmp, "state.pt"))
    else:
        _save_durable({k: state[k] for k in per_rank}, os.path.join(tmp, f"rng-rank-{rank:05d}.pt"))
    if collective:
        coll.barrier()
    if rank == 0:
        _write_meta(
            tmp,
            meta,
            {n: digest(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp)) if n.endswith(".pt")},
            sealer,
        )
        _fsync_dir(tmp)
        if os.path.isdir(final):  # the same step saved again (a retried run): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _prune(root, keep)
    if collective:
        coll.barrier()
    return final


def _write_meta(folder: str, meta: dict, files: dict[str, dict], sealer: Key) -> None:
    """meta.json with every file's entry (its pieces' sha256), sealed under the key (written
    whole, fsynced)."""
    atomic_write_json(os.path.join(folder, META), seal({**meta, "files": files}, sealer), indent=1)


def _prune(root: str, keep: int) -> None:
    if keep <= 0:
        return
    for old in list_steps(root)[:-keep]:
        shutil.rmtree(step_dir(root, old), ignore_errors=True)


def list_steps(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for d in os.listdir(root) if (m := STEP_DIR.match(d)))


def latest(root: str) -> str | None:
    steps = list_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def read_meta(path: str, sealer: Key | None = None) -> dict:
    """A checkpoint's meta.json, once its HMAC verifies under the key (this process's by
    default); CheckpointError naming the folder when it is missing, unreadable or not sealed
    under the key."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    return unseal(_raw_meta(folder), folder, sealer or key())


def _raw_meta(folder: str) -> dict:
    where = os.path.join(folder, META)
    if not os.path.isfile(where):
        raise CheckpointError(
            f"checkpoint {folder}: no {META}, so nothing vouches for its files (its sealed list of "
            "every file's sha256): refusing it. Give a folder a save wrote whole (OUT/checkpoints/step-N, "
            "OUT/best/step-N), with its meta.json"
        )
    try:
        with open(where) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {folder}: {META} unreadable ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"checkpoint {folder}: {META} is not a JSON object")
    return raw


def _files(folder: str, meta: dict) -> dict:
    files = meta.get("files")
    if not isinstance(files, dict) or "state.pt" not in files:
        raise CheckpointError(f"checkpoint {folder}: {META}'s file list is damaged")
    return files


def verify(folder: str) -> None:
    """Raise CheckpointError unless meta.json's HMAC verifies and every file it lists has the
    bytes it recorded."""
    _check_files(folder, _files(folder, read_meta(folder)))


def _check_files(folder: str, files: dict) -> None:
    for name, entry in files.items():
        if not os.path.isfile(os.path.join(folder, os.path.basename(name))):
            raise CheckpointError(f"checkpoint {folder}: {name} is missing")
        with VerifiedFile(folder, os.path.basename(name), entry) as f:
            f.check_all()


def latest_verified(root: str, log=None) -> str | None:
    """The newest checkpoint under root whose files verify; each one skipped is said, with why.
    Every rank of a group verifies every file, so they all pick the same one. A key problem
    (none, or checkpoints sealed under another key or none) raises CheckpointKeyError: it
    would refuse every checkpoint alike, and starting over would hide it."""
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    for step in reversed(list_steps(root)):
        folder = step_dir(root, step)
        try:
            verify(folder)
            return folder
        except CheckpointKeyError:
            raise
        except CheckpointError as e:
            say(f"skipping {e}; trying an older checkpoint")
    return None


def _torch_load(folder: str, name: str, files: dict):
    """`name`'s tensors, unpickled (weights_only) from pieces each checked against the sealed
    list as it is read (checkpoint_files.VerifiedFile)."""
    if name not in files:
        raise CheckpointError(f"checkpoint {folder}: {name} is not in its sealed {META}: refusing it")
    with VerifiedFile(folder, name, files[name]) as f:
        try:
            return torch.load(cast(IO[bytes], f), map_location="cpu", weights_only=True)
        except Exception as e:  # a damaged or foreign file: one line, not a traceback
            if f.error is not None:  # a piece that did not match, raised inside torch
                raise f.error from None
            raise CheckpointError(
                f"checkpoint {os.path.join(folder, name)} cannot be loaded safely: {str(e).splitlines()[0]}"
            ) from None


def load(path: str, rank: int = 0, per_rank: tuple = ("rng",)) -> dict:
    """Read a checkpoint folder (or its state.pt) without executing code; rank >= 1 gets its own RNG."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    if not os.path.isfile(os.path.join(folder, "state.pt")):
        raise CheckpointError(
            f"checkpoint {path}: no state.pt there (expected a folder like OUT/checkpoints/step-00000100)"
        )
    files = _files(folder, read_meta(folder))
    state = _torch_load(folder, "state.pt", files)
    if rank > 0:
        name = f"rng-rank-{rank:05d}.pt"
        if not os.path.isfile(os.path.join(folder, name)):
            raise CheckpointError(
                f"checkpoint {folder} has no RNG state for rank {rank}: it was written by a "
                "smaller group; resume with the same number of ranks"
            )
        mine = _torch_load(folder, name, files)
        missing = [k for k in per_rank if k not in mine]
        if missing:
            raise CheckpointError(
                f"checkpoint {folder}: rank {rank}'s file lacks {', '.join(missing)} (written with "
                "another comm.embedding); resume with the same comm.embedding"
            )
        state.update({k: mine[k] for k in per_rank})
    return state


def warm_start(model: torch.nn.Module, path: str, shards_path: str) -> int:
    """Load an earlier model's weights into `model` (optimizer and schedule start fresh).

    New data gives new dense item ids, so the item table is copied row by row through the
    raw ids of both shard sets' item maps (dataprep/schema.py ITEM_MAP): known items keep
    their learned embedding, new items keep their fresh initialization. Returns the number
    of item rows carried over. Raises CheckpointError when the model shapes differ.
    """
    import pyarrow.parquet as pq

    from dataprep.schema import ITEM_MAP

    old = load(path)["model"]
    new = model.state_dict()
    mismatched = [k for k in new if k != "item_emb.weight" and (k not in old or old[k].shape != new[k].shape)]
    if mismatched:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model ({', '.join(mismatched[:3])} differ): "
            "warm-start needs the same model.* settings as the earlier run"
        )
    old_map_path = os.path.join(read_meta(path).get("shards") or "", ITEM_MAP)
    if not os.path.isfile(old_map_path):
        raise CheckpointError(
            f"checkpoint {path}: its shard set's item map {old_map_path} is gone; "
            "warm-start needs it to match items by their raw ids"
        )
    old_ids = pq.read_table(old_map_path).to_pydict()
    new_ids = pq.read_table(os.path.join(shards_path, ITEM_MAP)).to_pydict()
    row_of_raw = dict(zip(old_ids["raw_id"], old_ids["id"], strict=True))
    pairs = [
        (nid, row_of_raw[raw]) for nid, raw in zip(new_ids["id"], new_ids["raw_id"], strict=True) if raw in row_of_raw
    ]
    table = new["item_emb.weight"].clone()
    if pairs:
        dst, src = torch.tensor(pairs).T
        table[dst] = old["item_emb.weight"][src]
    model.load_state_dict({**{k: old[k] for k in new if k != "item_emb.weight"}, "item_emb.weight": table})
    return len(pairs)


def rekey(folder: str, old: Key | None = None) -> str:
    """Seal FOLDER's meta.json under this process's key: a checkpoint from before keyed
    checkpoints (the sha256s it recorded checked first, or recorded now when it has none), or
    one sealed under the key `old` (verified under it first). Returns what it did, in a line.
    Vouches for the files as they are: re-key only what you trust."""
    sealer = key()
    raw = _raw_meta(folder)
    meta = unseal(raw, folder, old or sealer) if SEAL in raw else raw
    how = "checked against the sha256s it recorded"
    if meta.get("files") is None:
        names, how = sorted(n for n in os.listdir(folder) if n.endswith(".pt")), "hashed now (it recorded none)"
    else:
        names = list(_files(folder, meta))
        for name, entry in meta["files"].items():  # before keyed checkpoints: each file's sha256
            path = os.path.join(folder, os.path.basename(name))
            if isinstance(entry, str) and not (os.path.isfile(path) and sha256_file(path) == entry):
                raise CheckpointError(
                    f"checkpoint {folder}: {name} is missing or does not match the sha256 it recorded; not re-keyed"
                )
        _check_files(folder, {n: e for n, e in meta["files"].items() if not isinstance(e, str)})
    if "state.pt" not in names:
        raise CheckpointError(f"checkpoint {folder}: no state.pt there: nothing to re-key")
    files = {n: digest(os.path.join(folder, n)) for n in names}
    _write_meta(folder, {n: v for n, v in meta.items() if n != "files"}, files, sealer)
    return f"{folder}: sealed under {KEY_ENV} {sealer.path} (key id {sealer.id}); {len(files)} file(s) {how}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.checkpoint", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    n = sub.add_parser("new-key", help=f"make a key file (0600) unless FILE exists; point {KEY_ENV} at it")
    n.add_argument("file")
    r = sub.add_parser("rekey", help=f"seal checkpoint folders under the key {KEY_ENV} names")
    r.add_argument("folders", nargs="+", metavar="FOLDER")
    r.add_argument("--from-key-file", help="the key they are sealed under now (rotation); default: none or this one")
    a = p.parse_args(argv)
    if a.command == "new-key":
        existed = os.path.exists(a.file)
        path = ensure_key_file(a.file)
        print(f"{path}: {'exists, kept' if existed else 'a new key (0600)'}; export {KEY_ENV}={path.resolve()}")
        return 0
    try:
        old = key_from_file(a.from_key_file) if a.from_key_file else None
        for folder in a.folders:
            print(rekey(folder, old))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
