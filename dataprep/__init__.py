"""dataprep: raw interactions -> user sequences -> per-sample cost -> length-balanced shards."""
