"""`python -m benchmarks real-chats`: prefix-cache hit rates of real multi-turn chats through
the gateway, per routing policy, through `kvserve up` and the openai client only.

The chats of benchmarks/data/tenant_chats.json (tenants, each with a system prompt its
conversations share) are replayed: each user turn is sent with the whole history, through the
gateway with the tenant's own API key (`--api-keys-file`, so salts keep tenants apart), at
temperature 0, and the model's real answer is appended. `--concurrency` conversations run at
once, started in turn across tenants. Per policy: the hit rate from the workers'
`vllm:prefix_cache_hits_total` / `..._queries_total` deltas, and from the answers'
`usage.prompt_tokens_details.cached_tokens`; the ideal (every token that an earlier request of
the same tenant had in its prompt, in whole blocks) bounds both.
"""

from __future__ import annotations

import argparse
import json
import secrets
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

from benchmarks import ROOT
from benchmarks.cli_fleet import CliProcess, counter_total

CHATS = ROOT / "benchmarks" / "data" / "tenant_chats.json"
POLICIES = ("round_robin", "prefix_hash", "cache_aware", "precise")
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("real-chats", help="prefix-cache hit rates of real multi-turn chats "
                                          "through the gateway, per policy")
    p.add_argument("--model", required=True, help="model directory (or GGUF) the workers serve")
    p.add_argument("--chats", type=Path, default=CHATS, help="conversations file (JSON)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--num-kv-blocks", type=int, default=160,
                   help="KV blocks per worker: small, so that placement matters")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per answer")
    p.add_argument("--concurrency", type=int, default=4, help="conversations at once")
    p.add_argument("--out", type=Path, help="write every turn and the summary here (JSON)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    data = json.loads(args.chats.read_text())
    work = Path(tempfile.mkdtemp(prefix="kvserve-real-chats-"))
    keys = {t["name"]: f"key-{i}-{secrets.token_hex(12)}" for i, t in enumerate(data["tenants"])}
    keys_file = work / "api-keys.txt"
    keys_file.write_text("".join(f"{t} {k}\n" for t, k in keys.items()))
    results: dict[str, Any] = {}
    for policy in args.policies.split(","):
        if policy not in POLICIES:
            raise SystemExit(f"unknown policy {policy!r}: choose from {', '.join(POLICIES)}")
        extra = ["--workers", str(args.workers), "--policy", policy,
                 "--api-keys-file", str(keys_file), "--block-size", str(args.block_size),
                 f"--worker-arg=--num-kv-blocks={args.num_kv_blocks}",
                 f"--worker-arg=--block-size={args.block_size}",
                 f"--worker-arg=--max-model-len={args.max_model_len}"]
        with CliProcess.up(args.model, work / f"up-{policy}.log", extra) as fleet:
            before = _counters(fleet.worker_urls)
            turns = replay(fleet.url, data["tenants"], keys, args.max_tokens, args.concurrency)
            after = _counters(fleet.worker_urls)
            for turn in turns:
                turn["prompt_ids"] = _tokenize(fleet.worker_urls[0], turn["messages"], True)
                turn["computed_ids"] = _tokenize(fleet.worker_urls[0], [
                    *turn["messages"], {"role": "assistant", "content": turn["answer"]}], False)
        results[policy] = summarize(turns, before, after, args.block_size)
        results[policy]["answers"] = [{k: v for k, v in t.items() if not k.endswith("_ids")}
                                    for t in turns]
        _print_row(policy, results[policy])
        if args.out:  # after each policy: a long run cut short keeps what it measured
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def replay(url: str, tenants: list[dict[str, Any]], keys: dict[str, str], max_tokens: int,
           concurrency: int) -> list[dict[str, Any]]:
    """Every conversation, turn by turn, `concurrency` at once; the turns in the order they
    were sent (`seq`), each with the messages sent and the answer's usage."""
    order: list[tuple[dict[str, Any], int]] = []  # (tenant, conversation index), interleaved
    for i in range(max(len(t["conversations"]) for t in tenants)):
        order += [(t, i) for t in tenants if i < len(t["conversations"])]
    clients = {name: openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0,
                                   timeout=600.0) for name, key in keys.items()}
    model = clients[tenants[0]["name"]].models.list().data[0].id
    lock = threading.Lock()
    turns: list[dict[str, Any]] = []

    def converse(job: tuple[dict[str, Any], int]) -> None:
        tenant, index = job
        messages: list[dict[str, str]] = [{"role": "system", "content": tenant["system"]}]
        for number, user in enumerate(tenant["conversations"][index]):
            messages.append({"role": "user", "content": user})
            with lock:
                seq = len(turns)
                turns.append({})  # its place in send order
            response = clients[tenant["name"]].chat.completions.create(
                model=model, messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens, temperature=0.0)
            answer = response.choices[0].message.content or ""
            usage = response.usage
            assert usage is not None, "kvserve reports usage on every answer"
            details = usage.prompt_tokens_details
            turns[seq] = {"seq": seq, "tenant": tenant["name"], "conversation": index,
                          "turn": number, "messages": list(messages),
                          "prompt_tokens": usage.prompt_tokens,
                          "cached_tokens": (details.cached_tokens or 0) if details else 0,
                          "answer": answer}
            messages.append({"role": "assistant", "content": answer})

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(converse, order))
    return turns


def _counters(worker_urls: Sequence[str]) -> dict[str, float]:
    pages = [httpx.get(f"{u}/metrics", timeout=30.0).text for u in worker_urls]
    return {name: sum(counter_total(p, name) for p in pages) for name in (HITS, QUERIES)}


def _tokenize(worker_url: str, messages: list[dict[str, str]], generation_prompt: bool,
              ) -> list[int]:
    response = httpx.post(f"{worker_url}/tokenize", json={
        "messages": messages, "add_generation_prompt": generation_prompt}, timeout=60.0)
    response.raise_for_status()
    return list(response.json()["tokens"])


def ideal_cached_tokens(turns: Sequence[tuple[str, Sequence[int], Sequence[int]]],
                        block_size: int) -> list[int]:
    """Per turn (tenant, prompt ids, ids computed: the prompt and the answer), in send order:
    the tokens an unbounded prefix cache, salted per tenant, could serve: the longest prefix
    shared with what an earlier turn of the same tenant computed, in whole blocks, never the
    whole prompt (its last token is computed)."""
    ideal = []
    for i, (tenant, ids, _) in enumerate(turns):
        shared = 0
        for other_tenant, _, other in turns[:i]:
            if other_tenant != tenant:
                continue
            n = 0
            for a, b in zip(ids, other, strict=False):
                if a != b:
                    break
                n += 1
            shared = max(shared, n)
        ideal.append(min(shared, len(ids) - 1) // block_size * block_size)
    return ideal


def summarize(turns: list[dict[str, Any]], before: dict[str, float], after: dict[str, float],
              block_size: int) -> dict[str, Any]:
    ideal = ideal_cached_tokens([(t["tenant"], t["prompt_ids"], t["computed_ids"])
                                 for t in turns], block_size)
    for turn, tokens in zip(turns, ideal, strict=True):
        turn["ideal_cached_tokens"] = tokens
    prompt = sum(t["prompt_tokens"] for t in turns)
    cached = sum(t["cached_tokens"] for t in turns)
    hits, queries = after[HITS] - before[HITS], after[QUERIES] - before[QUERIES]
    return {"turns": len(turns), "prompt_tokens": prompt, "cached_tokens": cached,
            "usage_hit_rate": cached / prompt if prompt else 0.0,
            "metrics_hits": hits, "metrics_queries": queries,
            "metrics_hit_rate": hits / queries if queries else 0.0,
            "ideal_cached_tokens": sum(ideal), "ideal_hit_rate": sum(ideal) / prompt
            if prompt else 0.0}


def _print_row(policy: str, s: dict[str, Any]) -> None:
    print(f"{policy:<12} turns {s['turns']:>3}  prompt tokens {s['prompt_tokens']:>6}  "
          f"hit rate: metrics {s['metrics_hit_rate']:.3f} ({s['metrics_hits']:.0f}/"
          f"{s['metrics_queries']:.0f})  usage {s['usage_hit_rate']:.3f}  ideal "
          f"{s['ideal_hit_rate']:.3f}", flush=True)
