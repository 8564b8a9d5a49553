"""`python -m benchmarks.device_check`: the prepared GPU check, run in one call on a lent machine.

On a CUDA device it (1) builds a random-weight Llama of SmolLM2-135M's shape on the device (no
download), (2) checks kvserve's greedy tokens against transformers' on the same weights, in
float32 (must be identical) and bfloat16 (agreement reported), and (3) measures offline decode
tokens/s of kvserve's engine against transformers' batched `generate` on the same GPU, same
prompts, same lengths. It writes `device_check.json` and `device_check.md` under `--out`.
`--device cpu` runs the same steps here, small, as a smoke test of the script itself.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# SmolLM2-135M-Instruct's shape (the default model's), with random weights.
SMOLLM2_SHAPE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "hidden_act": "silu",
}


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (count, length), generator=gen).tolist()


def _kvserve_greedy(path: Path, device: str, dtype: str, prompts: list[list[int]],
                    max_tokens: int) -> tuple[list[list[int]], float]:
    from kvserve import LLM, SamplingParams
    llm = LLM(model=str(path), device=device, dtype=dtype, num_kv_blocks=4096, block_size=16,
              max_num_seqs=max(len(prompts), 1))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, temperature=0))
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return [list(o.outputs[0].token_ids) for o in outs], elapsed


def _hf_greedy(path: Path, device: str, dtype: str, prompts: list[list[int]],
               max_tokens: int, batched: bool) -> tuple[list[list[int]], float]:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    # transformers wraps `to` with functools.wraps(Module.to), so mypy sees `self` unbound
    model = model.to(device)  # type: ignore[arg-type]
    model.eval()
    kw = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False}
    groups = [prompts] if batched else [[p] for p in prompts]
    out: list[list[int]] = []
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=4,
                       do_sample=False)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        for group in groups:  # equal-length prompts: no padding, so batching changes nothing
            ids = torch.tensor(group, device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            out += gen[:, ids.shape[1]:].tolist()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return out, elapsed


def run(out_dir: Path, device: str, small: bool) -> dict[str, Any]:
    """Every step; each one's result (or its error) lands in the returned report."""
    import torch

    from kvserve.model import write_random_checkpoint
    shape = dict(SMOLLM2_SHAPE)
    if small:
        shape.update(num_hidden_layers=2, vocab_size=512)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else
        platform.processor() or platform.machine(),
        "torch": torch.__version__, "python": sys.version.split()[0], "shape": shape}
    work = Path(tempfile.mkdtemp(prefix="kvserve-device-"))
    path = write_random_checkpoint(work / "smollm2-shape", shape, seed=0)
    parity_prompts = _prompts(4 if small else 16, 24, shape["vocab_size"], seed=1)
    for dtype in ("float32", "bfloat16"):
        key = f"parity_{dtype}"
        try:
            mine, _ = _kvserve_greedy(path, device, dtype, parity_prompts, 16)
            theirs, _ = _hf_greedy(path, device, dtype, parity_prompts, 16, batched=False)
            same = sum(a == b for a, b in zip(mine, theirs, strict=True))
            tokens = sum(sum(x == y for x, y in zip(a, b, strict=False))
                         for a, b in zip(mine, theirs, strict=True))
            report[key] = {"prompts": len(mine), "identical_sequences": same,
                           "equal_token_positions": tokens,
                           "positions": sum(len(a) for a in mine)}
        except Exception as exc:  # one failing step must not hide the others' results
            report[key] = {"error": f"{type(exc).__name__}: {exc}"}
    count, length, new = (4, 32, 16) if small else (64, 128, 128)
    speed_prompts = _prompts(count, length, shape["vocab_size"], seed=2)
    for dtype in ("float32", "bfloat16"):
        key = f"throughput_{dtype}"
        try:
            _, mine_s = _kvserve_greedy(path, device, dtype, speed_prompts, new)
            _, theirs_s = _hf_greedy(path, device, dtype, speed_prompts, new, batched=True)
            report[key] = {"requests": count, "prompt_tokens": length, "output_tokens": new,
                           "kvserve_tok_s": round(count * new / mine_s, 1),
                           "transformers_tok_s": round(count * new / theirs_s, 1),
                           "ratio": round(theirs_s / mine_s, 3)}
        except Exception as exc:
            report[key] = {"error": f"{type(exc).__name__}: {exc}"}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "device_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "device_check.md").write_text(_markdown(report))
    return report


def _markdown(report: dict[str, Any]) -> str:
    lines = [f"# device check: {report['device']} (torch {report['torch']})", ""]
    for key, value in report.items():
        if key.startswith(("parity_", "throughput_")):
            lines.append(f"- {key}: " + ", ".join(f"{k}={v}" for k, v in value.items()))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_check", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="where the report files go")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a small smoke run)")
    args = p.parse_args(argv)
    report = run(args.out, args.device, small=args.device == "cpu")
    print(_markdown(report))
    failed = [k for k, v in report.items() if isinstance(v, dict) and "error" in v]
    fp32 = report.get("parity_float32", {})
    return 1 if failed or fp32.get("identical_sequences") != fp32.get("prompts") else 0


if __name__ == "__main__":
    sys.exit(main())
