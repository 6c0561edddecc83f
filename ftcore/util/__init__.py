"""ftcore's standard-library helpers: atomic file writes and file hashes (`files`), ports and
child processes (`procs`). What rests on ftcore (training, the Airflow plugin, the benchmarks)
may use them too; dataprep, which stands beside ftcore, has its own (dataprep/files.py)."""
