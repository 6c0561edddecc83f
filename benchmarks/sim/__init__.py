"""benchmarks.sim: a scale model of a training job under failures.

A discrete-event model (numpy) of a job of G GPUs as R replica groups: synchronous
training against FT-HSDP, effective training time against scale, replica-group
count and failure rate, and per-step bubbles of random against length-balanced
assignment. Validated against the FT-HSDP paper's figures; calibrated from ftrec's
own benchmark files. See README.md for the model and how the paper's inputs map
to its parameters. Run: `python -m benchmarks.sim --help` from the repository root.
The bubble model uses dataprep's balancer and cost model (benchmarks/sim/balance.py).
"""
