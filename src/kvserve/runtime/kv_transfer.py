"""Disaggregated prefill on the engine thread: copy a prompt's KV out, or take it in.

Every function here runs on the engine's thread (through `AsyncEngine.call`, or as an
`on_finish` hook), between steps, so it never races with the step's own KV writes and copies.
The prefill side: `export_prompt_blocks` copies out the KV of a just-finished prompt's full
blocks (found in the prefix cache by chained hash), so nothing stays held while the network is
slow. The decode side: `open_import` → `import_blocks` (reserve → write → confirm, per batch) →
the request is added with `kv_import=True`; `cancel_import` undoes an import at any point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.kvcache import ImportPlan, KVImports, SlotGrant, cached_block_ids, prompt_record
from kvserve.model.kv_export import read_blocks, write_host_slots
from kvserve.runtime.engine_info import EngineInfo
from kvserve.runtime.llm_engine import LLMEngine


@dataclass(frozen=True, slots=True)
class ExportedBlocks:
    """Copies of prompt blocks `[first_block, first_block + len(payloads))`: their hashes,
    token counts and KV payloads (kvserve.model.kv_export layout)."""

    first_block: int
    block_hashes: tuple[bytes, ...]
    payloads: tuple[bytes, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class ImportStart:
    """An opened import: the prompt's token ids (tokenized here) and what to fetch."""

    token_ids: tuple[int, ...]
    plan: ImportPlan


def prompt_block_hashes(info: EngineInfo, token_ids: Sequence[int], cache_salt: str | None,
                        stop: int, adapter_digest: bytes | None = None) -> list[bytes]:
    """The chained hashes of the prompt's first `stop` full blocks, as this worker keys them
    (the served model name is the cache's model id), under the LoRA adapter of
    `adapter_digest` (None: the base model)."""
    return prompt_record("", token_ids, cache_salt, info.model_name, info.limits.block_size,
                         stop, adapter_digest).block_hashes[:stop]


def export_prompt_blocks(engine: LLMEngine, token_ids: Sequence[int], cache_salt: str | None,
                         first: int, stop: int,
                         adapter_digest: bytes | None = None) -> ExportedBlocks | None:
    """Copy out the KV of the prompt's full blocks `[first, stop)`. Call it right after the step
    that computed the prompt (an `on_finish` hook): the blocks are cached and not yet reused.
    None when a block is not in the prefix cache (it was never computed here)."""
    kv = engine.kv_cache
    record = prompt_record("", token_ids, cache_salt, kv.model_id, kv.block_size, stop,
                           adapter_digest)
    block_ids = cached_block_ids(kv.pool, record, first, stop)
    if block_ids is None:
        return None
    payloads = read_blocks(engine.runner.kv_caches, block_ids)
    return ExportedBlocks(first, tuple(record.block_hashes[first:stop]), tuple(payloads),
                          kv.block_size)


def open_import(engine: LLMEngine, import_id: str, prompt: str | Sequence[int],
                cache_salt: str | None, adapter_digest: bytes | None = None) -> ImportStart:
    """Tokenize the prompt as the request will be, and open its import. Raises ValueError for a
    prompt the engine would refuse, or without a host tier."""
    token_ids = engine.encode(prompt)
    return ImportStart(tuple(token_ids), _imports(engine).open(import_id, token_ids, cache_salt,
                                                                adapter_digest))


def import_blocks(engine: LLMEngine, import_id: str,
                  blocks: Sequence[tuple[int, bytes, bytes]]) -> bool:
    """Take in received blocks (index, hash, verified payload), in order: reserve a host slot
    each, write them in one batch, confirm them (READY, pinned by the import). False when the
    host tier had no room for one: it and the blocks after it are not kept (the request
    computes them). Raises ValueError, with the import cancelled, for a block out of order,
    of another hash, or of the wrong size."""
    imports = _imports(engine)
    grants: list[SlotGrant] = []
    payloads: list[bytes] = []
    has_room = True
    try:
        for block_idx, block_hash, payload in blocks:
            grant = imports.reserve(import_id, block_idx, block_hash)
            if grant is None:
                has_room = False
                break
            if grant.needs_write:
                grants.append(grant)
                payloads.append(payload)
        write_host_slots(engine.runner.host_kv_caches, [g.slot_id for g in grants], payloads)
    except ValueError:
        imports.cancel(import_id)
        raise
    for grant in grants:
        imports.confirm(import_id, grant)
    return has_room


def cancel_import(engine: LLMEngine, import_id: str) -> int:
    """Undo an import (idempotent): unconfirmed slots freed, confirmed ones unpinned."""
    imports = engine.kv_cache.imports
    return imports.cancel(import_id) if imports is not None else 0


def _imports(engine: LLMEngine) -> KVImports:
    imports = engine.kv_cache.imports
    if imports is None:
        raise ValueError("this worker has no host KV tier to receive KV into; start it with "
                         "--kv-host-tier-bytes")
    return imports
