"""Set-up of the processes that run dataprep alone: its command line and its build's workers.

pyarrow imports pandas, where it is installed, when pyarrow.dataset is imported or an array is
first made from numpy, only to ask whether objects are pandas ones: ~0.2 s of CPU and ~30 MB in
every process (BENCHMARKS.md). dataprep uses no pandas, so its own processes refuse the
import (a finder first on sys.meta_path) and pyarrow goes on without it. A process that imports
dataprep as a library (an Airflow task, a notebook) is left as it is.
"""

import sys
from importlib.abc import MetaPathFinder

from dataprep import heap


class _NoPandas(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201
        if name.partition(".")[0] == "pandas":
            raise ModuleNotFoundError(f"no {name} in dataprep's own processes (dataprep.process)", name=name)
        return None


def own() -> None:
    """This process runs dataprep alone: no pandas import (unless one was made already)."""
    if "pandas" not in sys.modules and not any(isinstance(f, _NoPandas) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoPandas())


def worker() -> None:
    """A build worker process's set-up (dataprep.bucketed.Pool)."""
    own()
    heap.keep()
