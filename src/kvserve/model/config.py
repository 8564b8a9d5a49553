"""ModelConfig: the architecture facts kvserve reads from a Hugging Face ``config.json``.

Only decoder-only models of the Llama family are accepted (Llama, Mistral, Qwen2, Qwen3); they
differ in a handful of switches (attention biases, q/k norms, sliding windows, rope scaling) that
are all made explicit here so the model code never looks at the raw dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.model.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)
# HF's defaults when config.json omits the key (they differ per architecture for a few keys).
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6
_QWEN3_DEFAULT_HEAD_DIM = 128
_MISTRAL_DEFAULT_SLIDING_WINDOW = 4096
_QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A supported rope scaling: ``linear`` uses ``factor`` only; ``llama3`` uses all fields."""

    rope_type: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Immutable architecture description of one checkpoint.

    Build it with ``from_dict``/``from_file``: they validate every value and raise
    ``ModelLoadError`` naming the file and key, so a config they return is self-consistent.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rotary
    sliding_windows: tuple[int | None, ...]  # per layer; None = full causal attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype  # the checkpoint's stored dtype

    @property
    def num_queries_per_kv(self) -> int:
        """How many query heads share one KV head (1 = MHA, >1 = GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read and validate ``config.json`` (a file, or a directory that contains one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: file not found; a model directory needs "
                                 "config.json") from None
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot read it as JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: expected a JSON object at the top level")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Validate a parsed HF config; ``source`` names the file in error messages."""
        reader = _Reader(raw, source)
        arch = _architecture(raw, source)
        for key in _REQUIRED_KEYS:
            reader.positive_int(key)
        num_heads = reader.positive_int("num_attention_heads")
        num_kv_heads = reader.positive_int("num_key_value_heads", default=num_heads)
        hidden_size = reader.positive_int("hidden_size")
        default_head_dim = _QWEN3_DEFAULT_HEAD_DIM if arch == "Qwen3ForCausalLM" else None
        head_dim = reader.positive_int("head_dim", default=default_head_dim, allow_null=True)
        if head_dim is None:
            if hidden_size % num_heads:
                raise reader.error("head_dim", "is absent and hidden_size is not divisible by "
                                   "num_attention_heads; add an explicit head_dim")
            head_dim = hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise reader.error("num_key_value_heads", f"({num_kv_heads}) must divide "
                               f"num_attention_heads ({num_heads})")
        if head_dim % 2:
            raise reader.error("head_dim", f"({head_dim}) must be even for rotary embeddings")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise reader.error("hidden_act", f"is {act!r}; only 'silu' is supported")
        num_layers = reader.positive_int("num_hidden_layers")
        rope_theta, rope_scaling = _rope(raw, reader)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(isinstance(i, int) for i in eos_ids):
            raise reader.error("eos_token_id", "must be an int or a list of ints")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        uses_attention_bias = arch in ("LlamaForCausalLM", "Qwen3ForCausalLM")
        attention_bias = reader.flag("attention_bias") if uses_attention_bias else False
        return cls(
            architecture=arch,
            vocab_size=reader.positive_int("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=reader.positive_int("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=reader.number("rms_norm_eps", _DEFAULT_RMS_NORM_EPS),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=reader.positive_int("max_position_embeddings"),
            tie_word_embeddings=reader.flag("tie_word_embeddings"),
            attention_bias=True if is_qwen2 else attention_bias,
            o_proj_bias=attention_bias,
            mlp_bias=reader.flag("mlp_bias") if arch == "LlamaForCausalLM" else False,
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_windows=_sliding_windows(raw, arch, num_layers, reader),
            bos_token_id=reader.positive_int("bos_token_id", default=None, allow_null=True,
                                             allow_zero=True),
            eos_token_ids=eos_ids,
            dtype=_dtype(raw, reader),
        )


class _Reader:
    """Typed access to a raw config dict with errors that name the file and the key."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def error(self, key: str, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: key '{key}' {problem}")

    def positive_int(self, key: str, *, default: Any = ..., allow_null: bool = False,
                     allow_zero: bool = False) -> Any:
        if key not in self.raw:
            if default is ...:
                raise self.error(key, "is missing; it is required for every supported "
                                 f"architecture ({', '.join(SUPPORTED_ARCHITECTURES)})")
            return default
        value = self.raw[key]
        if value is None and allow_null:
            return default
        smallest = 0 if allow_zero else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < smallest:
            raise self.error(key, f"must be a positive integer, got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise self.error(key, f"must be a positive number, got {value!r}")
        return float(value)

    def flag(self, key: str) -> bool:
        value = self.raw.get(key, False)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures")
    if archs is None and raw.get("model_type") in _ARCH_BY_MODEL_TYPE:
        return _ARCH_BY_MODEL_TYPE[raw["model_type"]]
    if not isinstance(archs, list) or not archs:
        raise ModelLoadError(f"{source}: key 'architectures' is missing; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    raise ModelLoadError(f"{source}: key 'architectures' is {archs}; kvserve supports only "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope(raw: dict[str, Any], reader: _Reader) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files write `rope_theta`
    # next to an optional `rope_scaling`. Both are read; the nested dict wins, as in HF.
    key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise reader.error(key, f"must be an object or null, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise reader.error(key, "is nested per layer type; only one global rope is supported")
    theta_raw = params.get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA))
    if isinstance(theta_raw, bool) or not isinstance(theta_raw, int | float) or theta_raw <= 0:
        raise reader.error("rope_theta", f"must be a positive number, got {theta_raw!r}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise reader.error("partial_rotary_factor", f"is {partial}; only 1.0 is supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise reader.error(key, f"has rope type {rope_type!r}; supported: "
                           f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta_raw), None
    needed = ["factor"]
    if rope_type == "llama3":
        needed += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    for name in needed:
        value = params.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise reader.error(key, f"needs a positive '{name}' for rope type {rope_type!r}, "
                               f"got {value!r}")
    fields = {name: params[name] for name in needed}
    if "original_max_position_embeddings" in fields:
        fields["original_max_position_embeddings"] = int(fields["original_max_position_embeddings"])
    if rope_type == "llama3" and fields["low_freq_factor"] == fields["high_freq_factor"]:
        raise reader.error(key, "has low_freq_factor == high_freq_factor; they must differ")
    return float(theta_raw), RopeScaling(rope_type=rope_type, **fields)


def _sliding_windows(raw: dict[str, Any], arch: str, num_layers: int,
                     reader: _Reader) -> tuple[int | None, ...]:
    # Mirrors HF: Mistral applies `sliding_window` (default 4096) to every layer; Qwen2/Qwen3 only
    # when `use_sliding_window` is true, and then to layers typed "sliding_attention" (by default
    # those at index >= max_window_layers); Llama never slides.
    if arch == "MistralForCausalLM":
        if "sliding_window" in raw and raw["sliding_window"] is None:
            return (None,) * num_layers
        window = reader.positive_int("sliding_window", default=_MISTRAL_DEFAULT_SLIDING_WINDOW)
        return (window,) * num_layers
    is_qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    if not is_qwen or not reader.flag("use_sliding_window"):
        return (None,) * num_layers
    window = reader.positive_int("sliding_window", default=None, allow_null=True)
    if window is None:
        return (None,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = reader.positive_int("max_window_layers", default=_QWEN_DEFAULT_MAX_WINDOW_LAYERS,
                                    allow_zero=True)
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise reader.error("layer_types", f"must list one type per layer ({num_layers})")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _dtype(raw: dict[str, Any], reader: _Reader) -> torch.dtype:
    key = "dtype" if "dtype" in raw else "torch_dtype"
    name = raw.get(key) or "float32"
    if name not in _DTYPES:
        raise reader.error(key, f"is {name!r}; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name]
