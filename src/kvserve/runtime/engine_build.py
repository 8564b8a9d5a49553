"""What `LLMEngine.from_args` wires together: the model and tokenizer loaded, the KV cache sized
and allocated in every tier, the runner (or the tensor-parallel executor over it), the scheduler
and the limits the server publishes.

`start_ranks` prepares this process (torch threads, host memory) and, with tensor parallelism,
starts the other ranks; `build_parts` loads and sizes everything on rank 0. Neither keeps
state: the engine owns what they return.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.chat_template import template_argument
from kvserve.engine import PreemptionMode, Scheduler, SchedulerConfig
from kvserve.kvcache import KVCacheManager
from kvserve.model import (
    Tokenizer,
    allocate_disk_kv_caches,
    allocate_host_kv_caches,
    allocate_kv_caches,
    kv_cache_bytes_per_block,
    read_model_config,
    resolve_model_path,
    resolve_tokenizer_path,
)
from kvserve.model.grammar import GrammarMasks, Grammars
from kvserve.model.kv_export import block_payload_bytes, kv_layout
from kvserve.model.runner import ModelRunner
from kvserve.model.sampler import Sampler
from kvserve.model.tensor_parallel import ShardSpec, check_shardable
from kvserve.runtime.collective_stats import CollectiveStats
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.engine_info import EngineInfo, EngineLimits
from kvserve.runtime.host_memory import reuse_freed_host_memory
from kvserve.runtime.lora_registry import LoRARegistry
from kvserve.runtime.lora_setup import attach_lora
from kvserve.runtime.memory_budget import device_memory_bytes, kv_bytes_for_utilization
from kvserve.runtime.model_setup import kv_cache_torch_dtype, load_rank_model, rank_device
from kvserve.runtime.tp.executor import TensorParallelExecutor
from kvserve.runtime.tp.launch import RankGroup, Rendezvous


@dataclass(frozen=True, slots=True)
class EngineParts:
    """Everything an `LLMEngine` is constructed from, built once by `build_parts`."""

    info: EngineInfo
    tokenizer: Tokenizer
    scheduler: Scheduler
    executor: ModelRunner | TensorParallelExecutor
    eos_token_ids: frozenset[int]
    grammars: Grammars
    collective_stats: CollectiveStats | None
    lora: LoRARegistry | None


def start_ranks(args: EngineArgs, rendezvous: Rendezvous | None) -> RankGroup | None:
    """Set this process's torch threads and host memory reuse; with `tensor_parallel_size` > 1,
    check the model shards and start the other ranks (where `rendezvous`, default from the
    environment, says to). None on one rank."""
    torch.set_num_threads(args.resolve_num_threads())
    if args.reuse_host_memory and torch.device(args.device).type == "cpu":
        reuse_freed_host_memory()
    world_size = args.tensor_parallel_size
    if world_size <= 1:
        return None
    path = args.model_path()
    check_shardable(read_model_config(resolve_model_path(path), args.hf_config_path), world_size)
    return RankGroup(args, rendezvous or Rendezvous.from_env(world_size))


def build_parts(args: EngineArgs, group: RankGroup | None) -> EngineParts:
    """Load rank 0's model and the tokenizer, size and allocate the KV cache, and build the
    runner (driving `group`'s ranks, if any) and the scheduler. ValueError for sizes that
    disagree with the model (KV dtype, max_model_len)."""
    loaded, weight_bytes = load_rank_model(args, ShardSpec(0, args.tensor_parallel_size),
                                           rank_device(args.device, 0))
    template = template_argument(args.chat_template) if args.chat_template else None
    tokenizer_path = loaded.path if args.tokenizer is None else resolve_tokenizer_path(
        args.tokenizer, revision=args.revision, cache_dir=args.download_dir)
    tokenizer = Tokenizer.from_pretrained(tokenizer_path, chat_template=template)
    config = loaded.config
    rank_config = loaded.model.config  # this rank's heads (all of them on one rank)
    kv_dtype = kv_cache_torch_dtype(args, loaded.dtype)
    bytes_per_block = kv_cache_bytes_per_block(rank_config, args.block_size, kv_dtype)
    utilization_bytes = None
    if args.gpu_memory_utilization is not None:
        utilization_bytes = kv_bytes_for_utilization(
            args.gpu_memory_utilization, device_memory_bytes(loaded.device), weight_bytes)
    num_blocks = args.resolve_num_blocks(bytes_per_block, utilization_bytes)
    num_host_slots = args.resolve_num_host_slots(bytes_per_block)
    num_disk_slots = args.resolve_num_disk_slots(bytes_per_block)
    max_model_len = args.max_model_len or config.max_position_embeddings
    if max_model_len > config.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                         f"max_position_embeddings {config.max_position_embeddings}")
    name = args.served_name()
    kv_cache = KVCacheManager(num_blocks, args.block_size,
                              enable_prefix_caching=args.enable_prefix_caching,
                              enable_events=True, model_id=name,
                              num_host_slots=num_host_slots,
                              num_disk_slots=num_disk_slots)
    kv_caches = allocate_kv_caches(rank_config, num_blocks, args.block_size,
                                   dtype=kv_dtype, device=loaded.device)
    host_kv_caches = allocate_host_kv_caches(
        rank_config, num_host_slots, args.block_size, dtype=kv_dtype,
        pin_memory=torch.device(loaded.device).type == "cuda") if num_host_slots else []
    disk = allocate_disk_kv_caches(rank_config, num_disk_slots, args.block_size,
                                   dtype=kv_dtype, path=args.kv_disk_tier_path
                                   ) if num_disk_slots and args.kv_disk_tier_path else None
    eos = frozenset(loaded.eos_token_ids) | (
        {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    grammars = Grammars(tokenizer, config.vocab_size, eos)
    grammars.prepare_in_background()
    runner = ModelRunner(loaded.model, kv_caches, args.block_size,
                         Sampler(args.seed, loaded.device, GrammarMasks(grammars)),
                         host_kv_caches, disk.caches if disk else ())
    lora = attach_lora(args, loaded, runner)
    executor: ModelRunner | TensorParallelExecutor = runner
    collective_stats = None
    if group is not None:
        collective_stats = CollectiveStats(args.tensor_parallel_size)
        executor = group.connect(runner, num_blocks, collective_stats)
    scheduler = Scheduler(SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs,
                                          max_model_len, args.audit_interval_steps,
                                          args.idle_audit_interval_s,
                                          PreemptionMode(args.preemption_mode),
                                          args.max_loras), kv_cache)
    limits = EngineLimits(max_model_len, args.max_num_seqs, args.max_num_batched_tokens,
                          args.block_size, num_blocks)
    info = EngineInfo(name, Path(loaded.path), config.vocab_size, limits,
                      kv_layout(kv_caches), block_payload_bytes(kv_caches), args)
    return EngineParts(info, tokenizer, scheduler, executor, eos, grammars, collective_stats,
                       lora)
