"""kvserve.gateway — a cache-aware router in front of OpenAI-compatible workers.

`prefix` turns a request into chained, tenant-salted block hashes and `policies` picks a worker
from them; both are pure (no HTTP, asyncio or clock), so the fleet simulator runs the very same
code. Imports nothing from the engine layers (kvserve.engine, model, runtime, server).
"""
