"""Measurement of ftrec, kept out of the library packages (not part of the wheel).

One script per subsystem, each run from the repository root as `python benchmarks/<name>.py`
(the scale model as `python -m benchmarks.sim`); `make bench` runs them. Results go to
bench-results/. Names never repeat a package's (`dataprep_bench.py`, not `dataprep.py`): a
script's folder is first on `sys.path`, so such a file would hide the real package from it.

A script that imports a sibling (`from benchmarks.x import ...`) puts the repository root on
`sys.path` first.
"""
