"""What every rank of a tensor-parallel group must agree on, checked when a rank joins.

Ranks on other nodes (`kvserve serve --node-rank k`, torchrun) are started from their own
command lines, so nothing but this check stops a node with another model or group size from
joining: rank 0 publishes its `GroupIdentity` in the store before it loads anything, every other
rank compares its own with it before loading, and a rank that differs posts the difference under
REFUSED_KEY and exits, so both sides fail with the same named error instead of waiting on a
rendezvous that never completes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

import torch
from torch.distributed import Store

from kvserve.model import checkpoint_config_dict, resolve_model_path
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.tp.comm import TensorParallelError

IDENTITY_KEY = "kvserve/group"
REFUSED_KEY = "kvserve/refused"
FLAGS = {"tensor_parallel_size": "--tensor-parallel-size", "model_config": "--model",
         "block_size": "--block-size", "dtype": "--dtype", "device_type": "--device",
         "lora_slots": "--enable-lora/--max-loras/--max-lora-rank"}


@dataclass(frozen=True, slots=True)
class GroupIdentity:
    """The settings that must be equal on every rank. The model is compared by its config.json
    (without the keys HF writes about where it was saved), so the same checkpoint at another
    path on another node matches; `model` is only shown. `lora_slots` (adapters on or off, and
    the slots' count and width) must match because rank 0 fills every rank's slots."""

    tensor_parallel_size: int
    model_config: str  # sha256 of the canonical config.json
    block_size: int
    dtype: str
    device_type: str
    model: str
    lora_slots: str = "off"

    @classmethod
    def from_args(cls, args: EngineArgs) -> GroupIdentity:
        path = resolve_model_path(args.model_path(), revision=args.revision,
                                  cache_dir=args.download_dir)
        config = checkpoint_config_dict(path, args.hf_config_path)
        kept = {k: v for k, v in config.items()
                if not k.startswith("_") and k != "transformers_version"}
        digest = hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()
        lora = (f"{args.max_loras} slots of rank {args.max_lora_rank}" if args.enable_lora
                else "off")
        return cls(args.tensor_parallel_size, digest, args.block_size, args.dtype or "auto",
                   torch.device(args.device).type, args.served_name(), lora)

    def differences(self, other: GroupIdentity, rank: int) -> list[str]:
        """`flag: rank R has mine, rank 0 has other's` for each setting that differs."""
        out = []
        for field in fields(self):
            if field.name == "model":
                continue
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                if field.name == "model_config":
                    mine, theirs = f"{self.model} (config.json)", f"{other.model} (config.json)"
                out.append(f"{FLAGS[field.name]}: rank {rank} has {mine}, rank 0 has {theirs}")
        return out


def publish_identity(store: Store, args: EngineArgs) -> None:
    """Rank 0: post the settings the other ranks must match."""
    store.set(IDENTITY_KEY, json.dumps(asdict(GroupIdentity.from_args(args))))


def check_identity(store: Store, args: EngineArgs, rank: int) -> None:
    """Another rank: wait for rank 0's settings; if they differ from this rank's, post why and
    raise TensorParallelError naming each difference."""
    ours = GroupIdentity.from_args(args)
    theirs = GroupIdentity(**json.loads(store.get(IDENTITY_KEY).decode()))
    differences = ours.differences(theirs, rank)
    if differences:
        message = (f"tensor-parallel rank {rank} does not match rank 0 ({'; '.join(differences)}"
                   "): start every node with the same --model, --tensor-parallel-size, "
                   "--block-size, --dtype, --device and LoRA flags")
        store.set(REFUSED_KEY, message)
        raise TensorParallelError(message)


def refusal(store: Store) -> str | None:
    """Rank 0: why a rank refused to join, if one did."""
    return store.get(REFUSED_KEY).decode() if store.check([REFUSED_KEY]) else None
