"""The item table's gradient as the rows a step touched: (ids, values), never the whole table.

Under optim.item_optimizer = "rowwise_adam" the embedding's sparse gradient crosses the
group's ranks (`group_sum`: gathered, added in rank order, bitwise alike on every rank) and
the replica groups (`pack` into this group's slot of FTAR's fixed [groups, cap] buffer,
`unpack` after the average). `rows_bound` gives cap, the same on every group. A sharded
table sends only the slots, with shard-local row numbers.
"""

from __future__ import annotations

import torch

from ftcore import collectives as coll
from training import distributed


def touched(grad: torch.Tensor | None, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse (COO, one sparse dim) table gradient -> (sorted unique ids, summed rows), row 0 dropped."""
    if grad is None:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dim)
    g = grad.coalesce()
    ids, values = g.indices()[0], g.values()
    keep = ids != 0
    return ids[keep], values[keep]


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]], dim: int, dtype: torch.dtype) -> tuple:
    """Several (ids, rows) -> (sorted unique ids, their rows summed in the order of `parts`)."""
    ids = torch.cat([i for i, _ in parts]) if parts else torch.zeros(0, dtype=torch.int64)
    rows = torch.cat([r for _, r in parts]) if parts else torch.zeros(0, dim, dtype=dtype)
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    out = torch.zeros(unique.numel(), dim, dtype=dtype, device=rows.device)
    out.index_add_(0, inverse.to(rows.device), rows)  # sequential: part order, deterministic
    return unique, out


def group_sum(ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective over the replica group (no-op alone): the SUM of every rank's touched rows."""
    if not distributed.active():
        return ids, rows
    counts = [int(c) for c in coll.all_gather(torch.tensor([ids.numel()]), kind=coll.CONTROL)]
    n = max(counts)
    pad_ids = torch.zeros(n, dtype=torch.int64)
    pad_ids[: ids.numel()] = ids
    pad_rows = rows.new_zeros(n, rows.shape[1])
    pad_rows[: ids.numel()] = rows
    all_ids = coll.all_gather(pad_ids, kind=coll.DATA)
    all_rows = coll.all_gather(pad_rows, kind=coll.DATA)
    parts = [(i[:c], r[:c]) for i, r, c in zip(all_ids, all_rows, counts, strict=True)]
    return merge(parts, rows.shape[1], rows.dtype)


def pack(ids: torch.Tensor, rows: torch.Tensor, slot: int, slots: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This group's rows in slot `slot` of zeroed [slots, 1 + cap] ids / [slots, cap, dim] rows
    buffers; ids travel as id + 1 (0 marks an empty entry; a shard's local row 0 is a row)."""
    if ids.numel() > cap:
        raise RuntimeError(
            f"rowwise_adam: {ids.numel()} rows touched in one step, more than the bound {cap} "
            "computed from the shard set; use optim.item_optimizer=adam and report this"
        )
    id_buf = torch.zeros(slots, 1 + cap, dtype=torch.float64)
    id_buf[slot, 0] = 1.0
    id_buf[slot, 1 : 1 + ids.numel()] = ids.double() + 1
    row_buf = rows.new_zeros(slots, cap, rows.shape[1])
    row_buf[slot, : ids.numel()] = rows
    return id_buf, row_buf


def unpack(id_buf: torch.Tensor, row_buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Averaged slot buffers -> (sorted unique ids, rows added up in slot order)."""
    parts = []
    for s in range(id_buf.shape[0]):
        header = float(id_buf[s, 0])
        if header <= 0:  # a group that did not contribute
            continue
        n = round(1.0 / header)
        ids = torch.round(id_buf[s, 1:] * n).long()
        keep = ids > 0
        parts.append((ids[keep] - 1, row_buf[s][keep]))
    return merge(parts, row_buf.shape[2], row_buf.dtype)


def shard_step_counts(shards) -> list[list[int]]:
    """Per shard file (rank) and step (row group): input tokens + samples, from the Parquet
    metadata alone (the items column's value count: an upper bound of its tokens)."""
    out = []
    for rank in range(shards.world_size):
        md = shards.open_rank(rank).metadata
        col = next(j for j in range(md.num_columns) if md.schema.column(j).path.split(".")[0] == "items")
        groups = [md.row_group(s) for s in range(md.num_row_groups)]
        out.append([rg.num_rows + rg.column(col).num_values for rg in groups])
    return out


def rows_bound(
    step_counts: list[list[int]], shard_ranks: list[list[int]], negatives: tuple[int, int], num_items: int
) -> int:
    """Most rows one group can touch in a step, the same number on every group: the largest
    step of any group (its shards' tokens + samples: inputs and targets), plus the negatives,
    `negatives` = (per token, per step): loss.negatives_per(cfg). `shard_ranks[group]`: the
    shards it reads."""
    steps = len(step_counts[0]) if step_counts else 0
    most = max((sum(step_counts[r][s] for r in ranks) for ranks in shard_ranks for s in range(steps)), default=0)
    per_token, per_step = negatives
    return max(1, min(num_items, most + most * per_token + per_step))
