"""kvserve.model: run Hugging Face Llama-family checkpoints over a paged KV cache (torch).

The modules re-exported here import nothing from the rest of kvserve. Import from
``kvserve.model`` rather than its modules.
"""

from kvserve.model.attention_metadata import AttentionMetadata, compute_positions
from kvserve.model.checkpoint import demo_model_config, write_random_checkpoint
from kvserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from kvserve.model.disk_kv import DiskKV, allocate_disk_kv_caches
from kvserve.model.errors import ModelLoadError
from kvserve.model.host_kv import allocate_host_kv_caches, run_kv_transfers
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import (
    LoadedModel,
    checkpoint_config_dict,
    load_model,
    read_model_config,
    resolve_model_path,
    resolve_tokenizer_path,
)
from kvserve.model.paged_attention import (
    KVCache,
    allocate_kv_caches,
    kv_cache_bytes_per_block,
    paged_attention,
)
from kvserve.model.tokenizer import ChatTemplateError, Tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "ChatTemplateError",
    "DiskKV",
    "KVCache",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "RopeScaling",
    "Tokenizer",
    "allocate_disk_kv_caches",
    "allocate_host_kv_caches",
    "allocate_kv_caches",
    "checkpoint_config_dict",
    "compute_positions",
    "demo_model_config",
    "kv_cache_bytes_per_block",
    "load_model",
    "paged_attention",
    "read_model_config",
    "resolve_model_path",
    "resolve_tokenizer_path",
    "run_kv_transfers",
    "write_random_checkpoint",
]
