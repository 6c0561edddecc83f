"""Standard-library helpers that every package of the repository may import (ftcore itself,
dataprep, training, the Airflow plugin, the benchmarks): atomic file writes and file hashes
(`files`), ports and child processes (`procs`). Nothing here imports torch or pyarrow."""
