"""FreeScale communication inside a replica group: sharded item table, prioritized comm
overlap, the SM-free transport and bubble accounting.

One concept per module: transport (bytes between ranks), cuda_copy (its CUDA half),
sharded_embedding, item_table (the trainer's table), scheduler (the ordered comm queue),
bubbles (where step time goes), integration (GroupComm, the trainer's seam), config, spawn.
docs/training.md describes each; benchmarks/comm_bench.py measures them.
"""

import os

# Every wait in this package is bounded; one place, with an environment override.
COMM_TIMEOUT_S = float(os.environ.get("FTREC_COMM_TIMEOUT_S", "120"))
