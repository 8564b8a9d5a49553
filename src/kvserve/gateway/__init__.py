"""kvserve.gateway — a cache-aware router in front of OpenAI-compatible workers.

Folders show the layers (docs/design.md, "Routing"): `core/` is pure (tenancy, keys, the
routing pipeline, admission, one request's dispatch lifecycle; no HTTP, asyncio or clock), so
the fleet simulator runs the very same code; `fleet/` holds the live state around it (workers,
discovery, scraping, the KV-event index feed); `proxy/` and `epp/` are the two front ends,
siblings that never import each other; `cli/` builds both. Imports nothing from the engine
layers (kvserve.engine, model, runtime, server).
"""
