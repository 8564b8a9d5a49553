"""Record vLLM's greedy answers to chat prompts once, as test data kvserve is compared against.

Run from the peer venv (docs/peers.md); it imports nothing from kvserve:

    VLLM_CPU_OMP_THREADS_BIND=0-1 $PEERS/vllm-cpu/bin/python \
        benchmarks/peers/vllm_greedy_record.py --model DIR --prompts P.json --out OUT.json

P.json: {"conversations": [{"messages": [...]}, ...]} (tests/data/smollm2_chat_prompts.json) or
a list of user messages. Each conversation is rendered through the model's own chat
template (vLLM's tokenizer, `add_generation_prompt`), then answered greedily in float32 (eager) with
prefix caching off, up to `--max-tokens` tokens, stopping at the model's end of turn. OUT.json
holds vLLM's version, the model, and per prompt the prompt's token ids, the answer's token ids and
text, so a test can check kvserve's rendering and its answer token for token.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="float32", enable_prefix_caching=False, seed=0,
              max_model_len=2048, kv_cache_memory_bytes=256 << 20, enforce_eager=True)
    tokenizer = llm.get_tokenizer()
    with open(args.prompts, encoding="utf-8") as f:
        data = json.load(f)
    messages = ([c["messages"] for c in data["conversations"]] if isinstance(data, dict)
                else [[{"role": "user", "content": m}] for m in data])
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
             for m in messages]
    # the template writes every special token itself, as vLLM's chat route tokenizes it
    prompt_ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], params)
    record = {"vllm_version": importlib.metadata.version("vllm-cpu"), "model": args.model,
              "max_tokens": args.max_tokens, "dtype": "float32",
              "answers": [{"messages": m, "prompt_token_ids": ids,
                           "output_token_ids": list(o.outputs[0].token_ids),
                           "text": o.outputs[0].text}
                          for m, ids, o in zip(messages, prompt_ids, outputs, strict=True)]}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
