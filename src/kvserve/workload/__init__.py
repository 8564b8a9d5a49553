"""Workloads: real public traces and synthetic generators, as plain data (no engine imports).

Benchmarks and the simulator read the same `TraceRequest` stream, so a figure from one can be
checked against the other.
"""

from kvserve.workload.synthetic import MultiTenantSpec, multi_tenant_trace
from kvserve.workload.trace import (
    TRACE_BLOCK_SIZE,
    TraceFormatError,
    TraceRequest,
    load_azure_trace,
    load_mooncake_trace,
    load_trace,
    prompt_token_ids,
    write_mooncake_trace,
)

__all__ = [
    "TRACE_BLOCK_SIZE",
    "MultiTenantSpec",
    "TraceFormatError",
    "TraceRequest",
    "load_azure_trace",
    "load_mooncake_trace",
    "load_trace",
    "multi_tenant_trace",
    "prompt_token_ids",
    "write_mooncake_trace",
]
