"""What `kvserve bench engine` runs: the benchmark models and the token-id workloads.

Models are random-weight Llama checkpoints written once into a cache directory (atomically, so
two processes starting together never see half a checkpoint). Workloads are plain token ids drawn
from a seeded generator, so every system gets the very same prompts, and serialise to JSON for
the peer drivers.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DECODE_HEAVY = "decode-heavy"
SHARED_PREFIX = "shared-prefix"
WORKLOADS = (DECODE_HEAVY, SHARED_PREFIX)
FIRST_ORDINARY_TOKEN = 4  # ids below are the demo tokenizer's special tokens (<s>, </s>, ...)
MODEL_SEED = 4321
WARMUP_SEED_OFFSET = 1_000_003  # warm-up tokens never share a KV block with the timed ones
MODEL_NAMES = ("tiny", "100m")  # the keys of _model_configs()


def _model_configs() -> dict[str, dict[str, Any]]:
    from kvserve.model import demo_model_config

    base = demo_model_config()
    return {
        # The demo model (~3M params): per-step overhead dominates.
        "tiny": base,
        # ~125M params (49M of them in embeddings and lm_head): matrix work dominates.
        "100m": base | {
            "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
            "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
        },
    }


def bench_models_dir() -> Path:
    """`$KVSERVE_CACHE/bench-models`, else ~/.cache/kvserve/bench-models."""
    root = Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve")
    return root / "bench-models"


def ensure_bench_model(name: str, cache_dir: Path | None = None) -> Path:
    """Directory of a named benchmark model (written on first use), or `name` itself as a path.

    Raises ValueError for a name that is neither a known model nor an existing directory.
    """
    if name not in MODEL_NAMES:
        path = Path(name).expanduser()
        if not (path / "config.json").exists():
            raise ValueError(f"--model {name!r}: not one of {', '.join(MODEL_NAMES)} and not a "
                             "checkpoint directory (no config.json)")
        return path
    from kvserve.runtime.demo_model import ensure_random_checkpoint

    target = (cache_dir or bench_models_dir()) / name
    return ensure_random_checkpoint(target, _model_configs()[name], MODEL_SEED)


@dataclass(frozen=True, slots=True)
class WorkloadSizes:
    """Sizes of both workloads (CLI flags). Validated by `check`."""

    num_prompts: int = 32
    prompt_len: int = 128  # decode-heavy
    output_len: int = 128  # decode-heavy
    prefix_len: int = 1024  # shared-prefix
    suffix_len: int = 32  # shared-prefix
    prefix_output_len: int = 16  # shared-prefix
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError naming the first size that is not positive."""
        for name, value in asdict(self).items():
            if name != "seed" and value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1, got {value}")


@dataclass(frozen=True, slots=True)
class Workload:
    """One batch submitted at once: `prompts` (token ids), each generating exactly
    `max_tokens` tokens (greedy, EOS ignored). `warmup_prompts` are a smaller batch of the same
    shape with different tokens, run (untimed) before."""

    name: str
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    warmup_prompts: tuple[tuple[int, ...], ...]
    warmup_max_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def max_prompt_len(self) -> int:
        return max(len(p) for p in self.prompts)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "prompts": [list(p) for p in self.prompts],
                "max_tokens": self.max_tokens, "warmup_prompts": [list(p) for p in
                                                                  self.warmup_prompts],
                "warmup_max_tokens": self.warmup_max_tokens}


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(n))


def _prompts(name: str, sizes: WorkloadSizes, num: int, vocab: int,
             seed: int) -> tuple[tuple[int, ...], ...]:
    rng = random.Random(f"{name}/{seed}")
    if name == DECODE_HEAVY:
        return tuple(_tokens(rng, sizes.prompt_len, vocab) for _ in range(num))
    prefix = _tokens(rng, sizes.prefix_len, vocab)
    return tuple(prefix + _tokens(rng, sizes.suffix_len, vocab) for _ in range(num))


def build_workload(name: str, sizes: WorkloadSizes, vocab_size: int) -> Workload:
    """The workload `name` (one of WORKLOADS) for a model of `vocab_size`; same inputs, same ids."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if vocab_size <= FIRST_ORDINARY_TOKEN:
        raise ValueError(f"vocab_size {vocab_size} leaves no ordinary token")
    max_tokens = sizes.output_len if name == DECODE_HEAVY else sizes.prefix_output_len
    warmup_num = min(4, sizes.num_prompts)
    return Workload(
        name=name,
        prompts=_prompts(name, sizes, sizes.num_prompts, vocab_size, sizes.seed),
        max_tokens=max_tokens,
        warmup_prompts=_prompts(name, sizes, warmup_num, vocab_size,
                                sizes.seed + WARMUP_SEED_OFFSET),
        warmup_max_tokens=min(4, max_tokens),
    )
