"""Load one rank's model ready to serve: the same steps on rank 0 and on every other rank."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvserve.model import LoadedModel, cpu_kernels, load_model
from kvserve.model.gguf.locate import is_gguf
from kvserve.model.onednn_linear import has_native_bf16, onednn_available
from kvserve.model.quantized_model import gguf_weights, pack_quantized, quantize_weights
from kvserve.model.tensor_parallel import ShardSpec
from kvserve.runtime.engine_args import EngineArgs, kv_cache_dtype_name
from kvserve.runtime.memory_budget import model_bytes

_LOG = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_cache_torch_dtype(args: EngineArgs, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: the model's for "auto"; else the one asked for, where kvserve's
    attention reads it: the model's own, or bfloat16 or float16 under a float32 model (half the
    bytes a cached token; every attention path widens the rows as it reads them and computes in
    float32). ValueError for any other pairing, naming the ones that work."""
    name = kv_cache_dtype_name(args.kv_cache_dtype)
    if name is None:
        return model_dtype
    wanted = DTYPES[name]
    if wanted == model_dtype or (wanted in (torch.bfloat16, torch.float16)
                                 and model_dtype == torch.float32):
        return wanted
    model = str(model_dtype).removeprefix("torch.")
    raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype}: a {model} model's attention "
                     "reads a KV cache in its own dtype (a float32 model's also in bf16 or "
                     "fp16); pass --kv-cache-dtype auto, or --dtype float32 with a 16-bit cache")


def rank_device(device: str, local_rank: int) -> str:
    """A bare "cuda" means this node's GPU `local_rank` (one GPU per rank); else unchanged."""
    return f"cuda:{local_rank}" if device == "cuda" else device


def load_rank_model(args: EngineArgs, shard: ShardSpec, device: str) -> tuple[LoadedModel, int]:
    """Load `shard` of the model on `device`, with the CPU kernels and oneDNN packing applied
    as `args` asks (built now, not inside the first request); and the bytes of its weights as
    loaded (packing replaces them with copies the module tree no longer counts)."""
    path = args.model_path()
    dtype = DTYPES[args.dtype] if args.dtype else None
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not has_native_bf16():
        _LOG.warning("--dtype bfloat16: this CPU has no bf16 instructions (AVX512-BF16 or "
                     "AMX), where bf16 matmuls run slower than float32; running float32")
        dtype = torch.float32
    if args.quantization == "w8a8" and is_gguf(Path(path)):
        raise ValueError(f"quantization='w8a8' quantizes a dense checkpoint, but {path} is a "
                         ".gguf file; pass a directory of safetensors, or quantization='gguf' "
                         "to keep its blocks")
    loaded = load_model(path, device=device, dtype=dtype, shard=shard, revision=args.revision,
                        cache_dir=args.download_dir, hf_config_path=args.hf_config_path)
    weight_bytes = model_bytes(loaded.model)
    use_kernels = args.cpu_kernels and cpu_kernels.ENV_ENABLED
    cpu_kernels.set_enabled(use_kernels)
    if use_kernels and loaded.device.type == "cpu":
        cpu_kernels.families()  # build now, so the first step does not
    if args.quantization == "gguf":
        if not is_gguf(loaded.path):
            raise ValueError(f"quantization='gguf' keeps a .gguf model's blocks, but {path} is "
                             "not one; pass a gguf model (a .gguf file), or q4_0/q4_1/q8_0 "
                             "to quantize")
        pack_quantized(loaded.model, gguf_weights(loaded.path, loaded.config))
    elif args.quantization == "w8a8":
        loaded.model.pack_int8()
    elif args.quantization:
        pack_quantized(loaded.model, quantize_weights(loaded.model, args.quantization.upper()))
    elif args.onednn_linear and onednn_available(loaded.device, loaded.dtype):
        loaded.model.pack_for_onednn()
    return loaded, weight_bytes
