"""Tools around the benchmark: random checkpoints in the real on-disk formats, and the prepared GPU check."""
