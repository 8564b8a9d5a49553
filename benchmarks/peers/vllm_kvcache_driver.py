"""Replay a kvserve trace through vLLM's own KV cache manager (no engine, no model, CPU only).

Run from the peer venv (see docs/peers.md), with kvserve's sources on the path:

    PYTHONPATH=src $PEERS/vllm-cpu/bin/python benchmarks/peers/vllm_kvcache_driver.py \
        --trace PATH --capacity-tokens N --block-size B [--limit K]

Contract:
- Imports only `kvserve.workload` from kvserve; vLLM is imported at run time from the peer venv.
- Cache: one full-attention KV cache group of `capacity_tokens // block_size` usable blocks
  (`num_blocks` is one more, for the null block vLLM's `BlockPool` reserves), prefix caching on,
  block hashes chained with vLLM's default `sha256` (pickle + SHA-256) from its NONE_HASH seed.
- Replay, per request in file order: synthesize `prompt_token_ids(req, TRACE_BLOCK_SIZE)`, build a
  `vllm.v1.request.Request` (greedy, max_tokens=1; its block hashes are computed in the
  constructor), `get_computed_blocks` (lookup), `allocate_slots` for the uncached prompt tokens
  (allocate; with prefix caching this also caches every full prompt block), then `free` (blocks
  return to the pool, cached ones stay evictable in LRU order). A request whose allocation fails
  (prompt larger than the cache) is counted in `rejected` and contributes no tokens, hits or ops;
  `requests` counts every request read, rejected ones included. A request's `tenant`, if any, is
  its vLLM `cache_salt`, so tenants never share blocks (kvserve's replay salts the same way).
- Hits are vLLM's: whole cached blocks, capped at `prompt_len - 1` tokens, so a fully cached
  prompt still recomputes its last block (a full block when the prompt is block-aligned).
- Eviction is vLLM's: freed hashed blocks join the LRU tail (a request's tail blocks first), and a
  freed partial (unhashed) block goes to the head, to be reused before any cached block.
- Timed (`seconds`): the whole replay loop — token synthesis, Request construction (including block
  hashing), lookup, allocate and free. Not timed: trace loading and cache construction.
- Output: exactly one JSON object on stdout; vLLM's logs and all errors go to stderr, and errors
  exit non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import sys
import time
import traceback
from typing import Any

from kvserve.workload import TRACE_BLOCK_SIZE, load_trace, prompt_token_ids

OPS_PER_REQUEST = 3  # lookup, allocate, free


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True, help="Mooncake .jsonl or Azure .csv trace")
    parser.add_argument("--capacity-tokens", type=int, required=True, help="usable KV tokens")
    parser.add_argument("--block-size", type=int, required=True, help="tokens per KV block")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first K requests")
    args = parser.parse_args(argv)
    if args.block_size < 1 or args.capacity_tokens < args.block_size:
        parser.error("need block_size >= 1 and capacity_tokens >= block_size")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    return args


def replay(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    trace = load_trace(args.trace, args.limit)
    if not trace:
        raise ValueError(f"{args.trace}: no requests")
    block_size: int = args.block_size
    num_blocks = args.capacity_tokens // block_size + 1  # + vLLM's reserved null block
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)],
    )
    manager = KVCacheManager(
        kv_cache_config=config,
        # Large enough that no prompt is truncated; allocate_slots caps slots at this length.
        max_model_len=max(r.input_length for r in trace) + block_size,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=True,
    )
    usable = manager.block_pool.get_num_free_blocks()
    if usable != num_blocks - 1:
        raise RuntimeError(f"expected {num_blocks - 1} free blocks, vLLM reports {usable}")
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    prompt_tokens = hit_tokens = rejected = 0
    start = time.perf_counter()
    for req in trace:
        tokens = prompt_token_ids(req, TRACE_BLOCK_SIZE)
        request = Request(
            request_id=req.request_id,
            prompt_token_ids=tokens,
            sampling_params=params,
            pooling_params=None,
            arrival_time=req.arrival_ms / 1000.0,
            cache_salt=req.tenant,  # as kvserve's replay: tenants never share blocks
            block_hasher=hasher,
        )
        computed, num_hit, _ = manager.get_computed_blocks(request)
        new_blocks = manager.allocate_slots(request, len(tokens) - num_hit, num_hit, computed)
        if new_blocks is None:
            rejected += 1
            manager.free(request)  # drops the (empty) bookkeeping entry; frees nothing
            continue
        manager.free(request)
        prompt_tokens += len(tokens)
        hit_tokens += num_hit
    seconds = time.perf_counter() - start

    ops = OPS_PER_REQUEST * (len(trace) - rejected)
    return {
        "engine": "vllm",
        "vllm_version": importlib.metadata.version("vllm-cpu"),
        "hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "hit_tokens": hit_tokens,
        "prompt_tokens": prompt_tokens,
        "requests": len(trace),
        "rejected": rejected,
        "ops": ops,
        "seconds": seconds,
        "ops_per_s": ops / seconds if seconds > 0 else 0.0,
        "tokens_per_s": prompt_tokens / seconds if seconds > 0 else 0.0,
        "capacity_tokens": args.capacity_tokens,
        "block_size": block_size,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # vLLM logs to stdout by default; keep stdout for the one JSON line.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    stdout = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result = replay(args)
    except (ImportError, OSError, ValueError) as exc:  # no peer venv, bad trace or arguments
        print(f"vllm_kvcache_driver: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except Exception:  # a vLLM API change or a bug: keep the traceback
        traceback.print_exc()
        return 1
    stdout.write(json.dumps(result) + "\n")
    stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
