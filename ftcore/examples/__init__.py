"""Small self-contained workers that exercise ftcore end to end (tests, benchmarks)."""
