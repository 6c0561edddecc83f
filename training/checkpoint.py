"""Atomic checkpoints of `TrainState`, loaded without executing code.

OUT/checkpoints/step-N/ holds state.pt, rng-rank-K.pt (the group's other ranks) and
meta.json (step, config, fingerprint, topology, every file's sha256). The ranks write into
a .tmp folder that rank 0 renames into place after a barrier: a crash leaves a complete
checkpoint or a .tmp that nothing reads. A file is loaded (weights_only) only once its
sha256 matches; `latest_verified` is the newest checkpoint that verifies.
"""

import hashlib
import json
import os
import re
import shutil
import sys

import torch
import torch.distributed as dist

from ftcore import collectives as coll

STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint the user pointed at cannot be read; the message names it."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
    """
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
        files = {n: _sha256(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp)) if n.endswith(".pt")}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "files": files}, f, indent=1, default=str)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.isdir(final):  # the same step saved again (a retried run): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _prune(root, keep)
    if collective:
        coll.barrier()
    return final


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


def verify(folder: str) -> None:
    """Raise CheckpointError unless every file meta.json lists has the bytes it recorded.
    Checkpoints written before hashes were recorded (no `files`) pass unchecked."""
    files = read_meta(folder).get("files")
    if files is None:
        return
    if not isinstance(files, dict) or "state.pt" not in files:
        raise CheckpointError(f"checkpoint {folder}: meta.json's file list is damaged")
    for name, want in files.items():
        path = os.path.join(folder, os.path.basename(name))
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint {folder}: {name} is missing")
        if _sha256(path) != want:
            raise CheckpointError(
                f"checkpoint {folder}: {name} does not match the sha256 recorded when it was "
                f"written ({os.path.getsize(path)} bytes now): the file is damaged"
            )


def latest_verified(root: str, log=None) -> str | None:
    """The newest checkpoint under root whose files verify; each one skipped is said, with why.
    Every rank of a group verifies every file, so they all pick the same one."""
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    for step in reversed(list_steps(root)):
        folder = step_dir(root, step)
        try:
            verify(folder)
            return folder
        except CheckpointError as e:
            say(f"skipping {e}; trying an older checkpoint")
    return None


def load(path: str, rank: int = 0, per_rank: tuple = ("rng",)) -> dict:
    """Read a checkpoint folder (or its state.pt) without executing code; rank >= 1 gets its own RNG."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    fpath = os.path.join(folder, "state.pt")
    if not os.path.isfile(fpath):
        raise CheckpointError(
            f"checkpoint {path}: no state.pt there (expected a folder like OUT/checkpoints/step-00000100)"
        )
    if os.path.isfile(os.path.join(folder, "meta.json")):
        verify(folder)
    try:
        state = torch.load(fpath, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged or foreign file: one line, not a traceback
        raise CheckpointError(f"checkpoint {fpath} cannot be loaded safely: {str(e).splitlines()[0]}") from None
    if rank > 0:
        rpath = os.path.join(folder, f"rng-rank-{rank:05d}.pt")
        if not os.path.isfile(rpath):
            raise CheckpointError(
                f"checkpoint {folder} has no RNG state for rank {rank}: it was written by a "
                "smaller group; resume with the same number of ranks"
            )
        mine = torch.load(rpath, map_location="cpu", weights_only=True)
        missing = [k for k in per_rank if k not in mine]
        if missing:
            raise CheckpointError(
                f"checkpoint {folder}: rank {rank}'s file lacks {', '.join(missing)} (written with "
                "another comm.embedding); resume with the same comm.embedding"
            )
        state.update({k: mine[k] for k in per_rank})
    return state


def read_meta(path: str) -> dict:
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        with open(os.path.join(folder, "meta.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {folder}: meta.json unreadable ({e})") from None


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
