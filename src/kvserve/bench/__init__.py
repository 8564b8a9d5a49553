"""Benchmarks a user runs against their own deployment: `kvserve bench kvcache | engine | serve |
gateway`. Each measures kvserve and, where installed, its peer in the same run, and reports the
ratio (absolute times drift on shared machines). kvserve's development harnesses are the
repository's benchmarks/ (`python -m benchmarks`), which this package never imports."""
