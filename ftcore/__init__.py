"""ftcore: FT-HSDP fault-tolerant runtime (lighthouse, FTAR, commit vote, catch-up).

Depends on torch and the standard library only; never on training, dataprep or Airflow.
"""
