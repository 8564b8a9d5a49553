"""`LoRARequest`: vLLM's class for asking the offline API for an adapter, with its field names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter by name, vLLM's integer id and the path of its PEFT directory. The id is
    reported only: kvserve identifies an adapter's KV by the digest of what is at the path."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0 (vLLM's rule), got {self.lora_int_id}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
