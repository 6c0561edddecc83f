"""FreeScale communication: sharded embeddings, prioritized comm overlap, SM-free transport,
bubble accounting (measured by benchmarks/comm_bench.py; figures in BENCHMARKS.md, "FreeScale").

Modules, one concept each:
  transport.py          the byte mover: `collective` (torch.distributed) or `smfree`
                        (same-host shared memory on CPU; copy engines on CUDA), with fallback
  cuda_copy.py          the CUDA copy-engine pieces of `smfree` (UNVERIFIED here: no GPU)
  sharded_embedding.py  row-wise / table-wise sharded tables, lookups and grads by all-to-all
  scheduler.py          one ordered comm queue per rank; ops issued in need order, waited at use
  bubbles.py            per rank and step: compute, exposed comm, straggler wait, idle; PNG
  config.py             the trainer's `[comm]` config section
  integration.py        GroupComm: the trainer's seam (transport for grads, bubble metrics, PNG)
  spawn.py              run a function on W real gloo ranks, bounded (tests, benchmarks)

Measured outside the package: benchmarks/comm_bench.py, benchmarks/comm_trainer_bench.py, and
benchmarks/gpu_check.py, the one prepared <= 5 min device script (--cpu: its smoke test).
"""

import os

# Every wait in this package is bounded; one place, with an environment override.
COMM_TIMEOUT_S = float(os.environ.get("FTREC_COMM_TIMEOUT_S", "120"))
