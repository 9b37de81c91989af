"""Single-purpose measurement scripts (run as ``python -m benchmarks.tools.<name>`` from a checkout)."""
