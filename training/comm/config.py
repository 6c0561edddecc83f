"""The `[comm]` section of the trainer's config (FreeScale communication). No torch import:
the config loads anywhere, Airflow's DAG parser included."""

from dataclasses import dataclass

TRANSPORTS = ("collective", "smfree")
EMBEDDINGS = ("replicated", "sharded")
POLICIES = ("blocking", "overlapped", "prioritized")  # training/comm/scheduler.py


@dataclass
class CommConfig:
    """[comm] FreeScale communication (training/comm)."""

    transport: str = "collective"
    """"collective" | "smfree": the replica group's gradient all-reduce"""
    bubbles: bool = True
    """per-step compute / comm / straggler / idle accounting, logged to MLflow"""
    timeline_steps: int = 8
    """steps in the PNG timeline artifact (the run's last ones)"""
    embedding: str = "replicated"
    """"replicated" | "sharded": the item table row-sharded over the group's K ranks"""
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
