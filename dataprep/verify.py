"""verify_shards: prove a shard set is what its manifest says, before training trusts it.

Checks the manifest, every file's SHA-256 (and no unlisted file), the schemas, one file per
rank with `steps` non-empty row groups each holding only its step and rank, consistent
lengths, costs, item ids and timestamps, every sample exactly once, and the eval table and
maps sized as the manifest says (the list: docs/dataprep.md). The first problem raises
DataprepError.
"""

import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dataprep import schema
from dataprep.errors import DataprepError
from dataprep.files import sha256_file

REQUIRED = (
    "format_version",
    "created_at",
    "input",
    "config",
    "num_users",
    "num_items",
    "num_samples",
    "steps",
    "counts",
    "rejects",
    "imbalance",
    "bubble_fraction",
    "files",
)


def _fail(where, msg: str):
    raise DataprepError(f"{where}: {msg}")


def _schema_ok(path: Path, want, rel: str) -> pq.ParquetFile:
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - any read failure is a corrupt file
        _fail(rel, f"not a readable Parquet file ({e}); rebuild the shard set")
    got = f.schema_arrow
    if not got.equals(want, check_metadata=False):
        _fail(rel, f"schema differs from dataprep.schema: got {got}, want {want}; rebuild with this version")
    return f


def verify_shards(path: str, *, checksums: bool = True) -> dict:
    """Verify the shard set at `path`; returns its manifest or raises DataprepError."""
    root = Path(path)
    m = _manifest(root, path)
    has_time = schema.has_timestamps(m["format_version"])
    w, steps = int(m["config"]["world_size"]), int(m["steps"])
    _check_files(root, path, m, checksums)
    ids = [_check_rank(root, r, m, steps, has_time) for r in range(w)]
    _check_samples(path, np.concatenate(ids) if ids else np.zeros(0, np.int64), m)
    _check_tables(root, m, has_time)
    return m


def _manifest(root: Path, path: str) -> dict:
    """The set's manifest, with the keys and a format version this dataprep reads."""
    if not root.is_dir():
        _fail(path, "not a folder; give the shard-set folder written by `python -m dataprep shards`")
    mpath = root / schema.MANIFEST
    if not mpath.exists():
        _fail(path, f"no {schema.MANIFEST}: not a shard set, or an unfinished build")
    try:
        m = json.loads(mpath.read_text())
    except ValueError as e:
        _fail(mpath, f"not valid JSON ({e}); rebuild the shard set")
    missing = [k for k in REQUIRED if k not in m]
    if missing:
        _fail(mpath, f"missing keys {', '.join(missing)}; rebuild the shard set")
    if m["format_version"] not in schema.READ_VERSIONS:
        _fail(mpath, f"format_version {m['format_version']} but this dataprep reads {schema.READ_VERSIONS}; rebuild")
    return m


def _check_files(root: Path, path: str, m: dict, checksums: bool) -> None:
    """The files on disk are the manifest's, all there for its world size, with its checksums."""
    w = int(m["config"]["world_size"])
    files = m["files"]
    on_disk = {str(f.relative_to(root)) for f in root.rglob("*") if f.is_file()} - {schema.MANIFEST}
    if set(files) != on_disk:
        extra, gone = sorted(on_disk - set(files)), sorted(set(files) - on_disk)
        _fail(
            path, f"files differ from the manifest (missing: {gone[:5]}, unlisted: {extra[:5]}); rebuild the shard set"
        )
    want_files = {schema.shard_file(r) for r in range(w)} | {
        schema.EVAL_FILE,
        schema.USER_MAP,
        schema.ITEM_MAP,
        schema.REJECTS_FILE,
    }
    if want_files - set(files):
        _fail(path, f"missing files for world size {w}: {sorted(want_files - set(files))[:5]}")
    if checksums:
        for rel, digest in files.items():
            if sha256_file(root / rel) != digest:
                _fail(
                    root / rel,
                    "SHA-256 differs from the manifest: the file changed or is corrupt; rebuild the shard set",
                )


def _check_rank(root: Path, r: int, m: dict, steps: int, has_time: bool) -> np.ndarray:
    """Rank r's shard: one row group per step, none empty, its rows only, consistent columns;
    returns its sample ids."""
    cfg, num_items = m["config"], int(m["num_items"])
    cm = cfg["cost_model"]
    rel = schema.shard_file(r)
    f = _schema_ok(root / rel, schema.shard_schema(has_time), rel)
    if f.num_row_groups != steps:
        _fail(
            rel, f"{f.num_row_groups} row groups but the manifest says {steps} steps; every rank needs the same number"
        )
    t = f.read()
    step_col = t.column("step").to_numpy()
    counts = np.asarray([f.metadata.row_group(i).num_rows for i in range(steps)])
    if (counts == 0).any():
        _fail(rel, f"step {int(np.argmax(counts == 0))} is empty; every rank needs a sample in every step")
    expect = np.repeat(np.arange(steps), counts)
    if not np.array_equal(step_col, expect):
        bad = int(np.argmax(step_col != expect))
        _fail(rel, f"row {bad} has step {step_col[bad]} in row group {expect[bad]}; row group i must hold step i")
    if (t.column("rank").to_numpy() != r).any():
        _fail(rel, f"holds rows of another rank; expected only rank {r}")
    length = t.column("length").to_numpy()
    if not np.array_equal(pc.list_value_length(t.column("items")).to_numpy(), length):
        _fail(rel, "column length differs from len(items)")
    if (length < 1).any() or (length > int(cfg["max_len"])).any():
        _fail(rel, f"lengths must be in 1..max_len={cfg['max_len']}")
    want_cost = (cm["a"] * length + cm["b"]) * length + cm["c0"]
    if not np.allclose(t.column("cost").to_numpy(), want_cost, rtol=1e-9):
        _fail(rel, "cost differs from the manifest's cost model")
    if has_time:
        ts = t.column(schema.TIMESTAMPS)
        if not np.array_equal(pc.list_value_length(ts).to_numpy(), length):
            _fail(rel, "a sample's timestamps differ in number from its items")
        flat_ts = pc.list_flatten(ts).to_numpy()
        first = np.zeros(len(flat_ts), bool)
        first[np.cumsum(length)[:-1]] = True  # each sample's first item may be earlier than the last one's
        if (np.diff(flat_ts) < 0)[~first[1:]].any():
            _fail(rel, "timestamps go back in time inside a sample; items must be oldest first")
    flat = pc.list_flatten(t.column("items"))
    for name, col in (("items", flat), ("target", t.column("target"))):
        if len(col) and (pc.min(col).as_py() < 1 or pc.max(col).as_py() > num_items):
            _fail(rel, f"{name} holds ids outside 1..num_items={num_items}")
    return t.column("sample_id").to_numpy()


def _check_samples(path: str, ids: np.ndarray, m: dict) -> None:
    """Every sample written appears exactly once over the ranks (the tail policy's drops aside)."""
    written = int(m["counts"]["samples_written"])
    if len(ids) != written:
        _fail(path, f"{len(ids)} rows in the shards but the manifest says {written} samples written")
    u = np.unique(ids)
    if len(u) != len(ids):
        _fail(path, f"{len(ids) - len(u)} samples appear more than once; every sample must appear exactly once")
    if len(u) and (u[0] < 0 or u[-1] >= int(m["num_samples"])):
        _fail(path, f"sample ids outside 0..num_samples-1={int(m['num_samples']) - 1}")
    if written + int(m["counts"].get("samples_dropped_tail", 0)) != int(m["num_samples"]):
        _fail(path, "samples written + dropped tail differs from num_samples")


def _check_tables(root: Path, m: dict, has_time: bool) -> None:
    """The eval table, id maps and rejects: their schemas and the manifest's row counts."""
    num_items = int(m["num_items"])
    ev = _schema_ok(root / schema.EVAL_FILE, schema.eval_schema(has_time), schema.EVAL_FILE)
    want = int(m["counts"].get("eval_users", m["num_users"]))  # a temporal split tests some users only
    if ev.metadata.num_rows != want:
        _fail(schema.EVAL_FILE, f"{ev.metadata.num_rows} rows but the manifest's counts.eval_users is {want}")
    for rel, n in ((schema.USER_MAP, m["num_users"]), (schema.ITEM_MAP, num_items)):
        f = _schema_ok(root / rel, schema.MAP_SCHEMA, rel)
        if f.metadata.num_rows != int(n):
            _fail(rel, f"{f.metadata.num_rows} rows but the manifest says {n}")
    rj = _schema_ok(root / schema.REJECTS_FILE, schema.REJECTS_SCHEMA, schema.REJECTS_FILE)
    if rj.metadata.num_rows != sum(int(v) for v in m["rejects"].values()):
        _fail(schema.REJECTS_FILE, "row count differs from the manifest's rejects by reason")
