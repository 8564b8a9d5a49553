"""Drivers that replay kvserve workloads through peer engines, run from the peer's own venv."""
