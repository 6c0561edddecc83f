"""Set-up of the processes that run dataprep alone: its command line and its build's workers.

pyarrow imports pandas, where it is installed, when pyarrow.dataset is imported or an array is
first made from numpy, only to ask whether objects are pandas ones: ~0.2 s of CPU and ~30 MB in
every process (BENCHMARKS.md). dataprep uses no pandas, so its own processes refuse the
import (a finder first on sys.meta_path) and pyarrow goes on without it. Two defaults of their
environment change too, where the user set neither (and children inherit them): Arrow allocates
from glibc's malloc, which keeps freed memory for reuse while a build runs (dataprep.heap),
where its own pool (mimalloc) gives it back and faults fresh pages in again (zeroing them took
~10% of a 10M build's CPU); and numpy's BLAS runs in the calling thread, where its idle
threads spun (~1.5%; dataprep does no linear algebra to speak of). A process that imports
dataprep as a library (an Airflow task, a notebook) is left as it is.
"""

import os
import sys
from importlib.abc import MetaPathFinder

from dataprep import heap


class _NoPandas(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201
        if name.partition(".")[0] == "pandas":
            raise ModuleNotFoundError(f"no {name} in dataprep's own processes (dataprep.process)", name=name)
        return None


ENV = {"ARROW_DEFAULT_MEMORY_POOL": "system", "OPENBLAS_NUM_THREADS": "1"}  # read when each library loads


def own() -> None:
    """This process runs dataprep alone: no pandas import (unless one was made already), and
    ENV's defaults (before pyarrow and numpy are imported, to take effect here)."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if "pandas" not in sys.modules and not any(isinstance(f, _NoPandas) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoPandas())


def worker() -> None:
    """A build worker process's set-up (dataprep.bucketed.Pool)."""
    own()
    heap.keep()
