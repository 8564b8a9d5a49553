"""vLLM's KV-event wire (ZMQ frames of msgpack event batches) and its endpoint configuration,
shared by the workers that publish it (`kvserve serve --kv-events-config`) and the gateway that
follows it. Pure Python apart from the ZMQ sockets the callers own; imports no other layer."""
