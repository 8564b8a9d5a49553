"""`python -m benchmarks lora`: offline throughput with LoRA adapters against the base model.

One workload (random prompts, greedy, fixed output length) through three engines: the base
model with LoRA off; LoRA on with every request on the base model (the cost of being able to);
LoRA on with the requests spread round-robin over `--adapters` random adapters (rank
`--rank`, every projection targeted) in the same batches. Reports output tokens per second and
each one's ratio to the base model. `--kernels` also times the two batched-product forms
(kvserve.model.lora.punica: grouped by adapter vs gathered per token) on a decode batch of the
model's shapes. Adapters are written in PEFT's file format directly (no peft needed).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("lora", help="offline throughput: adapters mixed in a batch vs the base")
    p.add_argument("--model", required=True, help="a model directory (safetensors)")
    p.add_argument("--adapters", type=int, default=4, help="adapters in the mix (default 4)")
    p.add_argument("--rank", type=int, default=16, help="their rank (default 16)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=None)
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
    import torch

    from kvserve import LLM, LoRARequest, SamplingParams

    model = Path(args.model)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 20000, (args.prompt_len,),
                                                  generator=gen).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    common = dict(num_threads=args.num_threads, kv_cache_memory_bytes=256 << 20,
                  max_num_seqs=args.num_prompts)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(model, Path(tmp) / f"a{i}",
                                                                  args.rank, i)))
                    for i in range(args.adapters)]
        cases = [("base model, LoRA off", {}, None),
                 ("LoRA on, all requests base", {"enable_lora": True}, [None] * len(prompts)),
                 (f"LoRA on, {args.adapters} adapters (rank {args.rank}) mixed", {
                     "enable_lora": True}, [adapters[i % len(adapters)]
                                            for i in range(len(prompts))])]
        for name, extra, loras in cases:
            lora_args = ({"max_loras": args.adapters, "max_lora_rank": args.rank}
                         if extra else {})
            llm = LLM(str(model), **common, **extra, **lora_args)
            llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False,
                         lora_request=loras[:2] if loras else None)  # warm up
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append({"case": name, "output_tok_s": round(tokens / elapsed, 1),
                         "seconds": round(elapsed, 2)})
            del llm
    for row in rows:
        row["vs_base"] = round(row["output_tok_s"] / rows[0]["output_tok_s"], 3)
    if args.kernels:
        rows.extend(kernel_rows(model, args.adapters, args.rank))
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        for row in rows:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
    return 0


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
    out = []
    for name, fn in (("grouped by adapter (SGMV)", lambda o: sgmv_add(
            x, a, bs, o, slot_segments(seq_slots, query_start, torch.device("cpu")), rank)),
                     ("gathered per token (BGMV)", lambda o: bgmv_add(
                         x, a, bs, o, token_slots, rank))):
        times = []
        for _ in range(30):
            outs = [torch.zeros(rows_n, inter), torch.zeros(rows_n, inter)]
            start = time.perf_counter()
            fn(outs)
            times.append(time.perf_counter() - start)
        out.append({"case": f"gate/up delta, 32 decode rows, {name}",
                    "median_us": round(statistics.median(times) * 1e6, 1)})
    return out
