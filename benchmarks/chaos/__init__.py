"""`python -m benchmarks chaos`: a soak-and-chaos harness. A fleet of `kvserve serve` workers
behind two `kvserve gateway` replicas (precise, following the workers' KV events) and behind
Envoy + `kvserve epp`, open-loop load through the `openai` SDK, faults injected and recovered on
a schedule, everything recorded, judged and reported. It drives kvserve only through its CLI,
HTTP and ZMQ (never its modules), everything on loopback, every loop bounded in count and time.
"""
