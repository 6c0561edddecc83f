"""The shard-set layout: the one schema shared by dataprep (writer), training (reader),
ftcore's ledger and the Airflow tasks.

A set is a folder: manifest.json, shards/rank-NNNNN.parquet (row group i = step i),
eval.parquet, maps/users.parquet, maps/items.parquet, rejects.parquet. Item ids are dense,
1..num_items, 0 is padding. Inputs with real times add a `timestamps` column (format_version
2); sets without stay version 1, byte for byte. The layout in full: docs/dataprep.md.
"""

import pyarrow as pa

READ_VERSIONS = (1, 2)  # what readers (verify, training) accept
_TIME_VERSION = 2  # 1 + the timestamps column


def format_version(has_time: bool) -> int:
    """The version a writer stamps: 2 when the set carries timestamps, else 1."""
    return _TIME_VERSION if has_time else 1


def has_timestamps(version: int) -> bool:
    """Whether a set of manifest `format_version` carries the timestamps column."""
    return version >= _TIME_VERSION


MANIFEST = "manifest.json"
SHARDS_DIR = "shards"
EVAL_FILE = "eval.parquet"
USER_MAP = "maps/users.parquet"
ITEM_MAP = "maps/items.parquet"
REJECTS_FILE = "rejects.parquet"


def shard_file(rank: int) -> str:
    """Path of rank `rank`'s shard file, relative to the shard-set folder."""
    return f"{SHARDS_DIR}/rank-{rank:05d}.parquet"


SHARD_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.int64(), nullable=False),  # unique within the shard set
        pa.field("user_id", pa.int64(), nullable=False),  # dense user id
        pa.field("step", pa.int32(), nullable=False),  # global step (= row group index)
        pa.field("rank", pa.int32(), nullable=False),  # data-parallel rank
        pa.field("length", pa.int32(), nullable=False),  # len(items)
        pa.field("cost", pa.float64(), nullable=False),  # c(length) from the cost model
        pa.field("items", pa.list_(pa.int32()), nullable=False),  # input history, oldest first
        pa.field("target", pa.int32(), nullable=False),  # item after the last input
    ]
)

EVAL_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("history", pa.list_(pa.int32()), nullable=False),  # full training sequence, untruncated
        pa.field("valid_target", pa.int32(), nullable=False),  # second-to-last item
        pa.field("test_target", pa.int32(), nullable=False),  # last item
    ]
)

TIMESTAMPS = "timestamps"
SHARD_SCHEMA_TIME = SHARD_SCHEMA.append(
    pa.field(TIMESTAMPS, pa.list_(pa.int64()), nullable=False)
)  # epoch seconds of each input item
EVAL_SCHEMA_TIME = EVAL_SCHEMA.append(pa.field("history_timestamps", pa.list_(pa.int64()), nullable=False)).append(
    pa.field("valid_timestamp", pa.int64(), nullable=False)
)  # the test input's last item


def shard_schema(has_time: bool) -> pa.Schema:
    return SHARD_SCHEMA_TIME if has_time else SHARD_SCHEMA


def eval_schema(has_time: bool) -> pa.Schema:
    return EVAL_SCHEMA_TIME if has_time else EVAL_SCHEMA


# ids in sample order and times within a user ascend: delta encoding packs them in a few bits
_DELTA = ("sample_id", "user_id", TIMESTAMPS, "history_timestamps", "valid_timestamp")


def write_options(sch: pa.Schema) -> dict:
    """Parquet writer options for shard and eval files; every writer of them passes these, so the
    in-memory and the bucketed build write the same bytes. No dictionaries: ids and times hardly
    repeat within a row group, and trying one costs more time than it saves space."""
    leaf = {f.name: f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name for f in sch}
    return {"use_dictionary": False, "column_encoding": {leaf[n]: "DELTA_BINARY_PACKED" for n in _DELTA if n in leaf}}


MAP_SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),  # dense id
        pa.field("raw_id", pa.string(), nullable=False),  # id as it appeared in the input
    ]
)

REJECTS_SCHEMA = pa.schema(
    [
        pa.field("source", pa.string()),  # file name
        pa.field("line", pa.int64()),  # 1-based line or row number; null for per-user rejects
        pa.field("user", pa.string()),  # raw user id when known
        pa.field("reason", pa.string()),  # short snake_case reason, counted in the manifest
        pa.field("detail", pa.string()),
    ]
)

# manifest.json keys (all required):
#   format_version: int            1 (no timestamps) or 2 (timestamps column), see format_version()
#   created_at: str                ISO-8601 UTC
#   input: {paths: [str], format: str, fingerprint: str}   fingerprint = SHA-256 over the input bytes
#   config: {world_size, batch_size, max_len, seed, window_steps, cost_model: {a, b, c0}, tail: "drop"|"fill", ...}
#   num_users, num_items, num_samples: int   num_items = largest dense item id
#   steps: int                     steps per epoch; every rank has exactly this many row groups
#   counts: {events_read, events_used, duplicates, samples_written, samples_dropped_tail, samples_filled_tail, ...}
#   rejects: {reason: count}
#   imbalance: {p50, p99, max, mean}        per-step max/mean rank cost
#   bubble_fraction: float                  1 - total cost / (W * sum over steps of the max rank cost)
#   files: {relative_path: sha256}          every file of the set but manifest.json
#
# Added by dataprep (optional for readers; backward compatible):
#   config.batch_size is samples per rank per step on average; a step holds about W*B samples
#     (global_batch), split across ranks by cost, so ranks get different sample counts.
#   config.tail: "fill" = the N mod W*B leftover samples are spread over the steps (nothing lost,
#     counts.samples_filled_tail of them); "drop" = they are left out of the epoch
#     (counts.samples_dropped_tail, listed in rejects.parquet with reason "tail_dropped").
#   config.{method, dedup, max_events, reader_options}, global_batch, num_samples (training
#   samples built; = samples_written + samples_dropped_tail), over_lower_bound {p50, p99, max}
#   (per-step max rank cost / max(mean, largest sample) - 1), bubble_fraction_random (same
#   samples, plain shuffled equal-count assignment), bubble_fraction_lower_bound, total_cost,
#   timings {read_s, sequences_s, balance_s, write_s, total_s}.
#   timestamps {column, unit: "s", input_unit} (version 2 only): input_unit is the unit the
#     input's times were read in (s, ms, us or ns, from their magnitude), converted to seconds.
