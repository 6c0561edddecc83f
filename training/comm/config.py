"""The `[comm]` section of the trainer's config (FreeScale communication), and the two decisions
its "auto" defaults leave to the layout: the transport and the item table's placement (pure
functions of the facts, each returning its choice and the line the trainer logs). No torch
import: the config loads anywhere, Airflow's DAG parser included."""

from dataclasses import dataclass

TRANSPORTS = ("auto", "collective", "smfree")
EMBEDDINGS = ("auto", "replicated", "sharded")
POLICIES = ("blocking", "overlapped", "prioritized")  # training/comm/scheduler.py
LARGE_TABLE_BYTES = 256 << 20  # a replicated table's weights from this size up: sharded (K > 1)


@dataclass
class CommConfig:
    """[comm] FreeScale communication (training/comm)."""

    transport: str = "auto"
    """"auto" | "collective" | "smfree": the replica group's gradient all-reduce and the sharded
    table's all-to-alls; "auto": smfree on CUDA with K > 1 ranks (a fallback is logged), else collective"""
    bubbles: bool = True
    """per-step compute / comm / straggler / idle accounting, logged to MLflow"""
    timeline_steps: int = 8
    """steps in the PNG timeline artifact (the run's last ones)"""
    embedding: str = "auto"
    """"auto" | "replicated" | "sharded": the item table row-sharded over the group's K ranks;
    "auto": sharded with K > 1 when the table is large or its lookups move fewer bytes (logged)"""
    # "blocking" inline where the model needs them;
    # "overlapped" async in submission order, with batch i+1's id exchange during step i;
    # "prioritized" the same, issued in the order compute needs them (FreeScale)
    policy: str = "prioritized"
    """"blocking" | "overlapped" | "prioritized": how a sharded table's lookups run"""

    def checks(self) -> list[tuple[bool, str]]:
        """(ok, message) pairs for the trainer's config validation."""
        return [
            (self.transport in TRANSPORTS, f"comm.transport must be one of {', '.join(TRANSPORTS)}"),
            (self.timeline_steps >= 1, "comm.timeline_steps must be >= 1"),
            (self.embedding in EMBEDDINGS, f"comm.embedding must be one of {', '.join(EMBEDDINGS)}"),
            (self.policy in POLICIES, f"comm.policy must be one of {', '.join(POLICIES)}"),
        ]


def choose_transport(transport: str, device_type: str, ranks: int) -> tuple[str, str]:
    """(comm.transport to use, why): "auto" is smfree where copy engines can carry it (CUDA)
    and there is a peer to send to; on CPU the copies would run on the compute cores."""
    if transport != "auto":
        return transport, f"comm.transport={transport} (set)"
    if ranks < 2:
        return "collective", "comm.transport=auto: collective (1 rank per group: no traffic inside the group)"
    if device_type == "cuda":
        return "smfree", "comm.transport=auto: smfree on CUDA (copy engines, no SM kernels; a fallback is logged)"
    return "collective", f"comm.transport=auto: collective on {device_type} (no copy engines to move the bytes)"


def choose_embedding(
    embedding: str, ranks: int, num_items: int, dim: int, rows_per_step: float, dense_table_grad: bool
) -> tuple[str, str]:
    """(comm.embedding to use, why). "auto" with K > 1 ranks: sharded when the replicated table is
    large (LARGE_TABLE_BYTES), or when a step's lookups (rows_per_step rows out and their
    gradients back) move fewer bytes than the replicated table's dense gradient all-reduce
    (`dense_table_grad`: the item optimizer is dense Adam); else replicated."""
    if embedding != "auto":
        return embedding, f"comm.embedding={embedding} (set)"
    if ranks < 2:
        return "replicated", "comm.embedding=auto: replicated (1 rank per group: nothing to shard over)"
    table = (num_items + 1) * dim * 4
    lookups = int(2 * rows_per_step * dim * 4 * (ranks - 1) / ranks)
    mb = lambda b: f"{b / 2**20:.1f} MB"  # noqa: E731
    if table >= LARGE_TABLE_BYTES:
        return "sharded", f"comm.embedding=auto: sharded over {ranks} ranks (large table: {mb(table)})"
    if dense_table_grad and 0 < lookups < table:
        why = f"lookups {mb(lookups)} a step < the table's gradient {mb(table)}"
        return "sharded", f"comm.embedding=auto: sharded over {ranks} ranks (fewer bytes: {why})"
    why = f"{mb(table)}, lookups {mb(lookups)} a step" + ("" if dense_table_grad else ", row-wise gradient")
    return "replicated", f"comm.embedding=auto: replicated ({why})"
