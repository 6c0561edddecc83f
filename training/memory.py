"""The item table's memory, sized and checked before the model is built.

(items + 1) x dim float32 needs 6 copies under "adam" (weights, gradient, two moments,
temporaries), 3 under "rowwise_adam"; a sharded table holds 1/K per rank. The budget is
train.memory_budget_gb or 80% of the device's memory; the ranks agree on the smallest, then
take the replicated table, the sharded one when only it fits, or a ConfigError saying what fits.
"""

from __future__ import annotations

import math
import os

import torch

from ftcore import collectives as coll
from training import distributed
from training.comm import config as comm_config
from training.config import ConfigError

GB = 1 << 30
DEFAULT_FRACTION = 0.8  # of the device's memory, when train.memory_budget_gb is 0


def table_bytes(num_items: int, dim: int, item_optimizer: str, shards: int = 1) -> int:
    """Bytes one rank holds for the table and its optimizer state (see the module docstring)."""
    copies = 3 if item_optimizer == "rowwise_adam" else 6
    return math.ceil((num_items + 1) / shards) * dim * 4 * copies


def rank_budget(budget_gb: float, device: torch.device) -> int:
    """This rank's budget in bytes: the setting, or a share of the device's memory; the
    group's smallest (collective when the group has several ranks)."""
    if budget_gb > 0:
        budget = int(budget_gb * GB)
    elif device.type == "cuda":
        budget = int(DEFAULT_FRACTION * torch.cuda.get_device_properties(device).total_memory)
    else:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        budget = int(DEFAULT_FRACTION * host / max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1))
    if distributed.active():
        t = torch.tensor([budget], dtype=torch.float64)
        coll.all_reduce(t, kind=coll.CONTROL, op=torch.distributed.ReduceOp.MIN)
        budget = int(t.item())
    return budget


def lookup_rows(shards, negatives: tuple[int, int], groups: int, ranks: int) -> float:
    """Item rows a replica group looks up a step (inputs, targets, the negatives: `negatives` =
    (per token, per rank and step)): the sharded table's traffic, for comm.embedding=auto; 0
    when the manifest has no token count."""
    per_token, per_step = negatives
    try:
        return (2 + per_token) * shards.tokens_per_step / max(groups, 1) + ranks * per_step
    except Exception:  # DataError: an old manifest without counts.tokens
        return 0.0


def choose_embedding(
    embedding: str, num_items: int, dim: int, item_optimizer: str, ranks: int, budget: int, rows_per_step: float = 0.0
) -> tuple[str, str]:
    """(comm.embedding to use, a line for the log); raises ConfigError when nothing fits. "auto"
    is decided first (comm.config.choose_embedding: large table, or fewer bytes a step)."""
    if embedding == "auto":
        embedding, why = comm_config.choose_embedding(
            "auto", ranks, num_items, dim, rows_per_step, item_optimizer == "adam"
        )
        chosen, line = choose_embedding(embedding, num_items, dim, item_optimizer, ranks, budget)
        return chosen, f"{why}; {line}"
    gb = lambda b: f"{b / GB:.2f} GB"  # noqa: E731
    replicated = table_bytes(num_items, dim, item_optimizer)
    sharded = table_bytes(num_items, dim, item_optimizer, ranks)
    if (embedding == "replicated" or ranks == 1) and replicated <= budget:
        return embedding, f"item table {num_items} x {dim}: {gb(replicated)} per rank (budget {gb(budget)})"
    if ranks > 1 and sharded <= budget:
        how = "chosen" if embedding == "sharded" else "chosen automatically: the replicated one needs " + gb(replicated)
        return "sharded", f"item table sharded over {ranks} ranks, {gb(sharded)} per rank ({how}; budget {gb(budget)})"
    need = math.ceil(table_bytes(num_items, dim, item_optimizer) / budget)
    max_dim = budget // ((num_items + 1) * 4 * (3 if item_optimizer == "rowwise_adam" else 6))
    raise ConfigError(
        f"the item table ({num_items} items x model.dim={dim}, weights and Adam state) needs "
        f"{gb(replicated if ranks == 1 else sharded)} per rank, more than the budget of {gb(budget)} "
        f"(train.memory_budget_gb, default {DEFAULT_FRACTION:.0%} of the device): use comm.embedding=sharded "
        f"over {max(need, 2)} ranks (--ranks-per-group {max(need, 2)}), or model.dim <= {max_dim}"
        + (", or optim.item_optimizer=rowwise_adam" if item_optimizer == "adam" and ranks == 1 else "")
    )
