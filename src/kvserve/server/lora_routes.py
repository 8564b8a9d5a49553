"""LoRA adapters over HTTP, as vLLM serves them: `--lora-modules` at start,
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (behind the admin key here, since
a loaded adapter changes what every tenant's `model` may name), and adapters in `/v1/models`
with `parent` (the base model) and `root` (the adapter's path)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from kvserve.model.lora import LoRAFormatError
from kvserve.runtime import AsyncEngine, LLMEngine
from kvserve.runtime.lora_registry import LoRARegistry, UnknownAdapter
from kvserve.server.errors import APIError
from kvserve.server.vllm.routes import model_card


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One `--lora-modules` entry: `NAME=PATH` or vLLM's JSON form."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: Sequence[str]) -> list[LoRAModule]:
    """`--lora-modules` values; ValueError saying which entry is malformed and how to write it."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                raw = json.loads(value)
                modules.append(LoRAModule(raw["name"], raw["path"], raw.get("base_model_name")))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"--lora-modules {value!r}: the JSON form needs \"name\" and "
                                 f"\"path\" (and optionally \"base_model_name\"): {exc}") from exc
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: write NAME=PATH or "
                             '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
        modules.append(LoRAModule(name, path))
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names each adapter once; got {names}")
    return modules


def register_lora_modules(engine: LLMEngine, modules: Sequence[LoRAModule]) -> None:
    """Load `modules` into the engine's registry at start (ValueError names a bad one)."""
    if modules and engine.lora is None:
        raise ValueError("--lora-modules needs --enable-lora")
    for module in modules:
        assert engine.lora is not None
        if module.name == engine.model_name:
            raise ValueError(f"--lora-modules {module.name!r} is the base model's name; "
                             "name the adapter otherwise")
        engine.lora.add(module.name, module.path, base_model_name=module.base_model_name)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def adapter_cards(registry: LoRARegistry | None, base_name: str, created: int,
                  max_model_len: int) -> list[dict[str, Any]]:
    """/v1/models entries of the adapters, as vLLM lists them (`parent`: the base model)."""
    if registry is None:
        return []
    cards = []
    for entry in list(registry.entries.values()):
        card = model_card(entry.ref.name, entry.path, created, max_model_len)
        card["parent"] = entry.base_model_name or base_name
        cards.append(card)
    return cards


def add_lora_routes(app: FastAPI, engine: AsyncEngine,
                    require_admin_key: Callable[[Request], None]) -> None:
    """The two admin routes; 400 on a worker started without --enable-lora."""

    def registry() -> LoRARegistry:
        found = engine.lora
        if found is None:
            raise APIError(400, "this worker serves no LoRA adapters; start it with "
                           "--enable-lora", err_type="BadRequestError")
        return found

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(require_admin_key)])
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        adapters = registry()
        if body.lora_name == engine.info.model_name:
            raise APIError(400, f"{body.lora_name!r} is the base model's name",
                           err_type="BadRequestError", param="lora_name")
        try:
            await asyncio.to_thread(adapters.add, body.lora_name, body.lora_path,
                                    replace=body.load_inplace)
        except (LoRAFormatError, ValueError, OSError) as exc:
            raise APIError(400, str(exc), err_type="BadRequestError") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(require_admin_key)])
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        try:
            registry().remove(body.lora_name)
        except UnknownAdapter as exc:
            raise APIError(404, str(exc.args[0]), err_type="NotFoundError",
                           param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")
