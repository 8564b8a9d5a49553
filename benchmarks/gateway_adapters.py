"""`python -m benchmarks gateway --adapters N`: the routers over a fleet that serves N random LoRA
adapters, each tenant's requests naming one (kvserve.bench.gateway_lora: which adapter, what
every worker is started with, how loads are counted on kvserve's and vLLM's workers).

The flags, checked before anything starts, and the adapters written into the run's directory.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from kvserve.bench.gateway_fleet import SGLANG_ROUTER, RouterSpec
from kvserve.bench.gateway_lora import FleetAdapters

ADAPTER_ROUTERS = ("ideal,kvserve:cache_aware,kvserve:cache_aware@adapter_weight=0,"
                   "kvserve:lora_affinity,envoy+kvserve-epp:cache_aware")
DEFAULT_MAX_LORAS = 2
DEFAULT_ADAPTER_RANK = 8


def add_adapter_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument_group("LoRA adapters")
    a.add_argument("--adapters", type=int, default=None, metavar="N",
                   help="every worker serves N random adapters, tenant t's requests name "
                        "adapter t mod N; reports adapter loads per request (default routers: "
                        f"{ADAPTER_ROUTERS})")
    a.add_argument("--max-loras", type=int, default=None, metavar="K",
                   help=f"adapters in one batch per worker, its slots (default "
                        f"{DEFAULT_MAX_LORAS}; needs --adapters)")
    a.add_argument("--adapter-rank", type=int, default=None, metavar="R",
                   help=f"the adapters' rank (default {DEFAULT_ADAPTER_RANK}; needs --adapters)")


def check_adapter_arguments(args: argparse.Namespace, routers: Sequence[RouterSpec]) -> None:
    """Raise ValueError for flags that do not go together (before anything starts); fill in
    the defaults of --max-loras and --adapter-rank when --adapters is given."""
    if args.adapters is None:
        for flag, value in (("--max-loras", args.max_loras),
                            ("--adapter-rank", args.adapter_rank)):
            if value is not None:
                raise ValueError(f"{flag} sizes the LoRA adapters: give --adapters N too")
        return
    args.max_loras = DEFAULT_MAX_LORAS if args.max_loras is None else args.max_loras
    args.adapter_rank = (DEFAULT_ADAPTER_RANK if args.adapter_rank is None
                         else args.adapter_rank)
    if args.calibrate:
        raise ValueError("--calibrate simulates base-model requests only; drop it with "
                         "--adapters (the simulator's own adapter runs: `kvserve simulate "
                         "--adapters`)")
    sglang = [r.label for r in routers if r.kind == SGLANG_ROUTER]
    if sglang:
        raise ValueError(f"--adapters: {', '.join(sglang)} cannot be measured with adapters "
                         "(SGLang's router is not set up here to know LoRA adapters); drop it, "
                         "or leave --routers out for the adapter routers")


def write_fleet_adapters(args: argparse.Namespace, model_dir: Path,
                         out_dir: Path) -> FleetAdapters | None:
    """The --adapters adapters, written under `out_dir` for the model in `model_dir` (None
    without --adapters); ValueError for sizes out of range or a model that takes none."""
    if args.adapters is None:
        return None
    from benchmarks.lora_cli import write_adapter

    return FleetAdapters.write(model_dir, out_dir / "adapters", args.adapters, args.max_loras,
                               args.adapter_rank, write_adapter)
