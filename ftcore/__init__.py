"""ftcore: FT-HSDP's fault-tolerant runtime (lighthouse, relay, FTAR, commit vote, catch-up).

It depends on the standard library, torch, tenacity (the launcher's restarts), httptools and
uvloop (the lighthouse's HTTP parser and event loop); never on training, dataprep or Airflow.
The replica group is the unit of failure: a failed group restarts alone while the others
train on, and it catches up from a healthy one. The module map and the protocols: docs/ftcore.md."""
