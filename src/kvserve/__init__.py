"""kvserve — an LLM serving stack whose KV cache can be trusted and shared by many tenants.

`from kvserve import LLM, SamplingParams` is the offline API. The heavy parts (torch) load only
when `LLM` is first used, so the CLI and the pure layers start fast.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvserve.runtime import LLM

        return LLM
    if name == "LoRARequest":
        from kvserve.runtime.lora_request import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from kvserve.engine import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
