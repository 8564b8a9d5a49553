"""Operations: `kvserve doctor`, which diagnoses live workers and gateways over HTTP.

Reads only what the servers publish (/metrics, /health, /debug/kv, /v1/models, /workers), so it
imports none of the engine layers and works on vLLM workers where the names are shared.
"""
