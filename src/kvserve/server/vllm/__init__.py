"""kvserve.server.vllm: vLLM's flags, routes and metric names, as vLLM users type and
scrape them."""
