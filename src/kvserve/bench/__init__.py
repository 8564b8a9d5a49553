"""Benchmarks: `kvserve bench …`. Each measures kvserve and, where installed, its peer in the same
run, and reports the ratio (absolute times drift on shared machines)."""
