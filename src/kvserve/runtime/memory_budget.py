"""vLLM's `gpu_memory_utilization`, as a KV-cache size: the share of the device's memory this
worker may use, minus what the weights take.

On CUDA the device's memory is the GPU's total. On CPU it is the memory this process may use:
the machine's RAM, or the cgroup's limit when that is lower (a container). kvserve counts the
weights and the KV cache against the share; activations are small next to them here and are
not reserved (vLLM profiles them; say so when comparing sizes).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CGROUP_LIMIT_FILES = (Path("/sys/fs/cgroup/memory.max"),
                      Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of `device`: the GPU's, or on CPU the RAM (capped by a cgroup limit)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_LIMIT_FILES:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_bytes_for_utilization(utilization: float, total_bytes: int, weight_bytes: int) -> int:
    """`utilization` x `total_bytes` minus the weights; ValueError saying how to fix a share
    that leaves nothing for the KV cache."""
    budget = int(utilization * total_bytes) - weight_bytes
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"--gpu-memory-utilization {utilization:g} gives {utilization * total_bytes / gib:.2f} "
            f"GiB of {total_bytes / gib:.2f} GiB, which the weights ({weight_bytes / gib:.2f} GiB) "
            "already fill; raise it, or size the cache with --kv-cache-memory-bytes")
    return budget
