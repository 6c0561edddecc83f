"""The item table is sized before it is built (training/memory.py): it fits, the sharded
table is chosen automatically, or the run stops with a message that says what would fit."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import synthetic_shards

from training.config import ConfigError
from training.memory import GB, choose_embedding, table_bytes

ROOT = Path(__file__).resolve().parent.parent


def test_table_bytes_counts_weights_moments_and_the_dense_gradient():
    assert table_bytes(999, 64, "adam") == 1000 * 64 * 4 * 6  # + gradient and Adam's temporaries
    assert table_bytes(999, 64, "rowwise_adam") == 1000 * 64 * 4 * 3  # weights and moments
    assert table_bytes(999, 64, "rowwise_adam", shards=4) == 250 * 64 * 4 * 3  # a quarter each
    assert table_bytes(999, 64, "adam", shards=4) == 250 * 64 * 4 * 6


def test_ten_million_items_fit_one_rank_with_rowwise_adam_in_8gb():
    assert choose_embedding("replicated", 10_000_000, 64, "rowwise_adam", 1, 8 * GB)[0] == "replicated"
    with pytest.raises(ConfigError, match="or optim.item_optimizer=rowwise_adam"):
        choose_embedding("replicated", 10_000_000, 64, "adam", 1, 8 * GB)  # 15.4 GB


def test_the_sharded_table_is_chosen_when_only_it_fits():
    emb, line = choose_embedding("replicated", 10_000_000, 64, "adam", 4, 4 * GB)  # 3.8 GB a shard
    assert emb == "sharded" and "chosen automatically" in line
    assert choose_embedding("replicated", 1000, 64, "adam", 4, 4 * GB)[0] == "replicated"


def test_nothing_fits_says_how_many_ranks_or_which_dim():
    with pytest.raises(ConfigError) as e:
        choose_embedding("replicated", 10_000_000, 64, "adam", 1, 2 * GB)
    msg = str(e.value)
    assert "use comm.embedding=sharded over 8 ranks" in msg and "model.dim <= 8" in msg
    assert "train.memory_budget_gb" in msg


def test_the_trainer_refuses_a_table_over_budget_without_a_traceback(tmp_path):
    shards = synthetic_shards(tmp_path, users=100, items=90, seed=1, world_size=1, batch_size=8, max_len=10)
    p = subprocess.run(
        [sys.executable, "-m", "training", "train", "--shards", str(shards), "--out", str(tmp_path / "o")]
        + ["--set", "train.memory_budget_gb=0.00001", "mlflow.enabled=false"],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert "use comm.embedding=sharded over" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "o" / "checkpoints").exists()
