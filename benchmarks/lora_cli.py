"""`python -m benchmarks lora`: offline throughput with LoRA adapters against the base model.

One workload (random prompts, greedy, fixed output length, EOS ignored) through three engines:
the base model with LoRA off; LoRA on with every request on the base model (the cost of being
able to); LoRA on with the requests spread round-robin over `--adapters` random adapters (rank
`--rank`, every projection targeted) in the same batches. Reports output tokens per second and
each one's ratio to the base model. `--peer vllm` runs the same cases (same token ids, adapter
files, sampling, threads, fp32, one `generate` call of every prompt) through vLLM's CPU build
(benchmarks/lora_peer.py), adds kvserve/vLLM per case and how many prompts' greedy tokens the
two agree on. Each engine warms up on other prompts with every adapter of its case, untimed.
`--kernels` also times the two batched-product forms (kvserve.model.lora.punica: grouped by
adapter vs gathered per token) on a decode batch of the model's shapes. Adapters are written in
PEFT's file format directly (no peft needed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.lora_peer import (
    Case,
    Workload,
    agreement,
    driver_spec,
    run_vllm,
    vllm_max_lora_rank,
)

KV_CACHE_BYTES = 256 << 20  # both engines: holds 16 x 96 tokens of the 135M model many times


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("lora", help="offline throughput: adapters mixed in a batch vs the base")
    p.add_argument("--model", required=True, help="a model directory (safetensors)")
    p.add_argument("--adapters", type=int, default=4, help="adapters in the mix (default 4)")
    p.add_argument("--rank", type=int, default=16, help="their rank (default 16)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=None,
                   help="threads of both engines (default torch's); vLLM's OpenMP is bound to "
                   "cores 0..N-1")
    p.add_argument("--peer", choices=["none", "vllm"], default="none",
                   help="vllm: also run every case through vLLM's CPU build (docs/peers.md)")
    p.add_argument("--vllm-timeout", type=float, default=1800.0,
                   help="seconds per vLLM process (two: LoRA off, LoRA on)")
    p.add_argument("--kernels", action="store_true", help="also time grouped vs per-token")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.set_defaults(func=run)


def write_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    """A random PEFT-format adapter on every projection (A and B non-zero)."""
    import torch
    from safetensors.torch import save_file

    from kvserve.model import ModelConfig
    from kvserve.model.lora import TARGET_MODULES, module_shapes

    config = ModelConfig.from_file(model_dir / "config.json")
    shapes = module_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in TARGET_MODULES:
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            fan_in, fan_out = shapes[module]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(TARGET_MODULES), "bias": "none"}))
    return out


def run(args: argparse.Namespace) -> int:
    """Every case on kvserve (then on vLLM with `--peer vllm`), then the rows; 1 when a vLLM
    case failed (its row says why), 2 when the peer is missing."""
    import torch

    if min(args.adapters, args.rank, args.num_prompts, args.prompt_len, args.max_tokens) < 1:
        raise SystemExit("lora: --adapters, --rank, --num-prompts, --prompt-len and "
                         "--max-tokens must be at least 1")
    model = Path(args.model)
    vocab = json.loads((model / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    peer: tuple[Path, Path] | None = None
    if args.peer == "vllm":
        found = vllm_peer()
        if isinstance(found, str):
            print(f"lora: {found}", file=sys.stderr)
            return 2
        peer = found
        vllm_max_lora_rank(args.rank)  # a rank vLLM cannot take fails before kvserve runs
    threads = args.num_threads or torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    low, high = min(100, vocab // 2), min(20000, vocab)

    def random_prompts(n: int) -> list[list[int]]:
        return [torch.randint(low, high, (args.prompt_len,), generator=gen).tolist()
                for _ in range(n)]

    prompts = random_prompts(args.num_prompts)
    warmup_prompts = random_prompts(max(2, args.adapters))  # other tokens: no prefix hits
    cases = [Case("base model, LoRA off", False, [None] * len(prompts)),
             Case("LoRA on, all requests base", True, [None] * len(prompts)),
             Case(f"LoRA on, {args.adapters} adapters (rank {args.rank}) mixed", True,
                  [i % args.adapters for i in range(len(prompts))])]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [(f"a{i}", i + 1, str(write_adapter(model, Path(tmp) / f"a{i}", args.rank, i)))
                    for i in range(args.adapters)]
        workload = Workload(prompts, warmup_prompts, adapters, args.rank, args.max_tokens)
        kvserve = [run_kvserve(model, workload, case, threads) for case in cases]
        vllm: list[dict[str, Any]] = []
        if peer is not None:
            python, driver = peer
            for lora_on in (False, True):
                group = [c for c in cases if c.enable_lora is lora_on]
                spec = driver_spec(model, workload, group, threads, KV_CACHE_BYTES)
                results, info = run_vllm(python, driver, spec, args.vllm_timeout)
                vllm.extend(r | {"info": info} for r in results)
    for tail in dict.fromkeys(r["log_tail"] for r in vllm if "log_tail" in r):
        print(f"lora: vLLM failed; the end of its log:\n{tail}", file=sys.stderr)
    rows = throughput_rows(kvserve, vllm, threads)
    if args.kernels:
        rows.extend(kernel_rows(model, args.adapters, args.rank))
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print_tables(rows)
        for run_info in dict.fromkeys(json.dumps(r["info"]) for r in vllm if r.get("info")):
            print(f"vLLM run: {run_info}")
    return 1 if any("error" in r for r in vllm) else 0


def vllm_peer() -> tuple[Path, Path] | str:
    """vLLM's interpreter and this benchmark's driver, or why they cannot be used."""
    from kvserve.bench.peers_env import peer_driver, vllm_python, vllm_unavailable

    driver = peer_driver("vllm_lora_driver.py")
    python = vllm_python()
    why = vllm_unavailable(driver)
    if why is not None or python is None or driver is None:
        return why or "vLLM is not available"
    return python, driver


def run_kvserve(model: Path, workload: Workload, case: Case, threads: int) -> dict[str, Any]:
    """One case on a fresh kvserve LLM: warm-up, then one timed generate of every prompt."""
    from kvserve import LLM, LoRARequest, SamplingParams

    adapters = [LoRARequest(n, i, p) for n, i, p in workload.adapters]

    def requests(idx: list[int | None]) -> list[LoRARequest | None] | None:
        return [None if i is None else adapters[i] for i in idx] if case.enable_lora else None

    lora_args = ({"enable_lora": True, "max_loras": len(adapters), "max_lora_rank": workload.rank}
                 if case.enable_lora else {})
    llm = LLM(str(model), num_threads=threads, kv_cache_memory_bytes=KV_CACHE_BYTES,
              max_num_seqs=max(len(workload.prompts), len(workload.warmup_prompts)), **lora_args)
    llm.generate([{"prompt_token_ids": p} for p in workload.warmup_prompts],
                 SamplingParams(temperature=0, max_tokens=workload.warmup_max_tokens,
                                ignore_eos=True),
                 use_tqdm=False, lora_request=requests(workload.warmup_adapter_idx(case)))
    params = SamplingParams(temperature=0, max_tokens=workload.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params,
                        use_tqdm=False, lora_request=requests(case.adapter_idx))
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    return {"case": case.name, "seconds": seconds, "num_output_tokens": sum(map(len, tokens)),
            "output_token_ids": tokens}


def throughput_rows(kvserve: list[dict[str, Any]], vllm: list[dict[str, Any]],
                    threads: int) -> list[dict[str, Any]]:
    """Rows per system and case: output tok/s, its ratio to kvserve's base row and (with a
    peer) to its own system's base row and kvserve/vLLM; then, per case, how many greedy
    tokens the two systems agree on. A failed vLLM case keeps its error and no figures."""
    def tok_s(r: dict[str, Any]) -> float | None:
        return r["num_output_tokens"] / r["seconds"] if "error" not in r else None

    kv_base, vllm_base = tok_s(kvserve[0]), tok_s(vllm[0]) if vllm else None
    rows: list[dict[str, Any]] = []
    for system, results, base in (("kvserve", kvserve, kv_base), ("vllm", vllm, vllm_base)):
        for k, r in enumerate(results):
            rate = tok_s(r)
            row: dict[str, Any] = {"system": system, "case": r["case"], "threads": threads}
            if rate is None:
                rows.append(row | {"error": r["error"]})
                continue
            row |= {"output_tok_s": round(rate, 1), "seconds": round(r["seconds"], 2),
                    "vs_kvserve_base": ratio(rate, kv_base)}
            if vllm:
                kv_rate, vllm_rate = tok_s(kvserve[k]), tok_s(vllm[k])
                row |= {"vs_own_base": ratio(rate, base), "kvserve_over_vllm": ratio(
                    kv_rate, vllm_rate)}
            rows.append(row)
    for kv, peer in zip(kvserve, vllm, strict=False):
        if "error" not in peer:
            rows.append({"case": f"greedy tokens, kvserve vs vLLM: {kv['case']}",
                         **agreement(kv["output_token_ids"], peer["output_token_ids"])})
    return rows


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def print_tables(rows: list[dict[str, Any]]) -> None:
    """Markdown tables, one per run of rows with the same kind (throughput, agreement,
    kernels), columns the union of their keys in first-seen order, blank where absent."""
    def kind(row: dict[str, Any]) -> object:
        return "throughput" if "system" in row else frozenset(row)

    groups: list[list[dict[str, Any]]] = []
    for row in rows:
        if groups and kind(groups[-1][0]) == kind(row):
            groups[-1].append(row)
        else:
            groups.append([row])
    for group in groups:
        columns = list(dict.fromkeys(k for row in group for k in row))
        print("| " + " | ".join(columns) + " |")
        print("|" + "|".join("---" for _ in columns) + "|")
        for row in group:
            print("| " + " | ".join("" if row.get(c) is None else str(row[c])
                                     for c in columns) + " |")
        print()


def kernel_rows(model: Path, num_adapters: int, rank: int) -> list[dict[str, object]]:
    """Median time of one gate/up delta for a decode batch of 32 rows, both product forms."""
    import statistics

    import torch

    from kvserve.model import ModelConfig
    from kvserve.model.lora.punica import bgmv_add, sgmv_add, slot_segments

    config = ModelConfig.from_file(model / "config.json")
    gen = torch.Generator().manual_seed(1)
    rows_n, hidden, inter = 32, config.hidden_size, config.intermediate_size
    x = torch.randn(rows_n, hidden, generator=gen)
    a = torch.randn(num_adapters, 2 * rank, hidden, generator=gen)
    bs = [torch.randn(num_adapters, inter, rank, generator=gen) for _ in range(2)]
    seq_slots = [i % num_adapters for i in range(rows_n)]
    query_start = list(range(rows_n + 1))
    token_slots = torch.tensor(seq_slots)
    forms: list[tuple[str, Callable[[list[torch.Tensor]], None]]] = [
        ("grouped by adapter (SGMV)", lambda o: sgmv_add(
            x, a, bs, o, slot_segments(seq_slots, query_start, torch.device("cpu")), rank)),
        ("gathered per token (BGMV)", lambda o: bgmv_add(x, a, bs, o, token_slots, rank))]
    out = []
    for name, fn in forms:
        times = []
        for _ in range(30):
            outs = [torch.zeros(rows_n, inter), torch.zeros(rows_n, inter)]
            start = time.perf_counter()
            fn(outs)
            times.append(time.perf_counter() - start)
        out.append({"case": f"gate/up delta, 32 decode rows, {name}",
                    "median_us": round(statistics.median(times) * 1e6, 1)})
    return out
