"""kvserve.server.kv: KV over the wire: frames, /kv/prefill, the decode side's pull, the ZMQ
event publisher."""
