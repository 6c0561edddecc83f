"""The `[comm]` section of the trainer's config (FreeScale communication). No torch import:
the config loads anywhere, Airflow's DAG parser included."""

from dataclasses import dataclass

TRANSPORTS = ("collective", "smfree")
EMBEDDINGS = ("replicated", "sharded")


@dataclass
class CommConfig:
    transport: str = "collective"   # "collective" | "smfree": the replica group's gradient all-reduce
    bubbles: bool = True            # per-step compute / comm / straggler / idle accounting, logged to MLflow
    timeline_steps: int = 8         # steps in the PNG timeline artifact (the run's last ones)
    embedding: str = "replicated"   # "replicated" | "sharded": the item table row-sharded over the group's K ranks


def checks(cfg: CommConfig) -> list[tuple[bool, str]]:
    """(ok, message) pairs for the trainer's config validation."""
    return [(cfg.transport in TRANSPORTS, f"comm.transport must be one of {', '.join(TRANSPORTS)}"),
            (cfg.timeline_steps >= 1, "comm.timeline_steps must be >= 1"),
            (cfg.embedding in EMBEDDINGS, f"comm.embedding must be one of {', '.join(EMBEDDINGS)}")]
