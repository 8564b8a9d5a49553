"""A LoRA adapter in PEFT's format, read, checked against the base model and digested.

PEFT saves `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, `use_rslora`, ...) and
`adapter_model.safetensors` (`...layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight` [r, in] and
`lora_B.weight` [out, r]). kvserve serves adapters on q/k/v/o_proj and gate/up/down_proj; dropout
is a training-time switch and is ignored. Everything else an adapter could ask for (DoRA, biases,
per-module ranks, extra trained modules) is refused by name at load, before any request runs.

The adapter's identity is `digest`: sha256 of what changes its outputs (rank, alpha, rsLoRA and
every tensor's name, dtype, shape and bytes), never its name or path. The KV cache keys an
adapter's blocks by it, so a name reloaded with other weights starts new chains and two names of
the same files share theirs.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvserve.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_DIGEST_DOMAIN = b"kvserve.lora.v1"
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+?)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_REFUSED_FLAGS = {  # config key -> why kvserve refuses a true/non-empty value
    "use_dora": "DoRA adapters are not supported",
    "modules_to_save": "adapters that also train whole modules (modules_to_save) are not "
                       "supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style) weights are not supported",
}


class LoRAFormatError(ValueError):
    """An adapter directory kvserve cannot serve; the message says what and how to fix it."""


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One adapter, in host memory. `modules[(layer, module)]` = (A [rank, in], B [out, rank])
    with B already multiplied by `scaling` (alpha / rank, or alpha / sqrt(rank) with rsLoRA)."""

    path: str
    rank: int
    scaling: float
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: bytes  # sha256 of config and weights: the adapter's identity in the KV cache
    base_model_name: str | None = None

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.modules)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.modules.values())


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-targetable projection of the base model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    return {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size),
            "v_proj": (hidden, kv_size), "o_proj": (q_size, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def load_peft_adapter(path: str | Path, config: ModelConfig, max_rank: int,
                      dtype: torch.dtype) -> LoRAWeights:
    """Read and check the adapter at `path` for the base model `config`; weights cast to
    `dtype`. Raises LoRAFormatError naming the problem (missing files, a refused option, a rank
    above `max_rank`, an unknown target, a shape the base model does not have)."""
    root = Path(path)
    if not (root / CONFIG_FILE).is_file() or not (root / WEIGHTS_FILE).is_file():
        raise LoRAFormatError(f"{root} is not a PEFT LoRA adapter: it needs {CONFIG_FILE} and "
                              f"{WEIGHTS_FILE} (save it with peft's save_pretrained)")
    try:
        raw = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAFormatError(f"{root / CONFIG_FILE} is not valid JSON: {exc}") from exc
    rank, alpha, rslora = _check_config(raw, root, max_rank)
    tensors = load_file(str(root / WEIGHTS_FILE))
    shapes = module_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in shapes:
            raise LoRAFormatError(
                f"{root}: tensor {key!r} targets a module kvserve cannot adapt; LoRA targets "
                f"are {', '.join(TARGET_MODULES)} (retrain without the others)")
        layer, module = int(match.group(1)), match.group(2)
        if layer >= config.num_hidden_layers:
            raise LoRAFormatError(f"{root}: tensor {key!r} names layer {layer}, but the base "
                                  f"model has {config.num_hidden_layers} layers")
        halves.setdefault((layer, module), {})[match.group(3)] = tensor
    if not halves:
        raise LoRAFormatError(f"{root}: {WEIGHTS_FILE} holds no lora_A/lora_B weights")
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    digest = hashlib.sha256(_DIGEST_DOMAIN)
    digest.update(json.dumps({"r": rank, "alpha": alpha, "rslora": rslora}).encode())
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAFormatError(f"{root}: layer {layer} {module} has lora_{''.join(pair)} "
                                  "but not both lora_A and lora_B")
        a, b = pair["A"], pair["B"]  # [rank, in], [out, rank]
        in_features, out_features = shapes[module]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise LoRAFormatError(
                f"{root}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, but r={rank} on this base model needs "
                f"({rank}, {in_features}) and ({out_features}, {rank}): the adapter was "
                "trained for another base model")
        for name, tensor in (("A", a), ("B", b)):
            digest.update(f"{layer}.{module}.{name}:{tensor.dtype}:{tuple(tensor.shape)}"
                          .encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        modules[(layer, module)] = (a.to(dtype).contiguous(),
                                    (b.to(torch.float32) * scaling).to(dtype).contiguous())
    base = raw.get("base_model_name_or_path")
    return LoRAWeights(str(root), rank, scaling, modules, digest.digest(),
                       base if isinstance(base, str) else None)


def _check_config(raw: object, root: Path, max_rank: int) -> tuple[int, float, bool]:
    """(rank, alpha, use_rslora) from adapter_config.json, after refusing what kvserve cannot
    serve."""
    if not isinstance(raw, dict):
        raise LoRAFormatError(f"{root / CONFIG_FILE} must hold a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoRAFormatError(f"{root}: peft_type {raw['peft_type']!r} is not a LoRA adapter")
    for key, why in _REFUSED_FLAGS.items():
        if raw.get(key):
            raise LoRAFormatError(f"{root}: {why}")
    if raw.get("bias", "none") != "none":
        raise LoRAFormatError(f"{root}: bias={raw['bias']!r} adapters are not supported "
                              "(train with bias='none')")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAFormatError(f"{root}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAFormatError(f"{root}: rank {rank} is above --max-lora-rank {max_rank}; "
                              f"raise --max-lora-rank to at least {rank}")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, int | float):
        raise LoRAFormatError(f"{root}: lora_alpha must be a number, got {alpha!r}")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise LoRAFormatError(f"{root}: unknown target modules {unknown}; kvserve adapts "
                                  f"{', '.join(TARGET_MODULES)}")
    return rank, float(alpha), bool(raw.get("use_rslora", False))
