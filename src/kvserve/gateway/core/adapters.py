"""Which LoRA adapter a request runs under, and where each worker has adapters loaded, as the
routing core sees them. Pure: the fleet feeds it (scrapes, KV events), and the proxy, the
Endpoint Picker and the simulator read it alike.

A request runs under an adapter when its `model` names one a worker lists (`/v1/models`
entries with a `parent`, as vLLM and kvserve list adapters), or when the operator maps its
tenant to one (`--tenant-adapter TENANT=ADAPTER`): the gateway then sends the request's
`model` as that adapter, so the tenant's fine-tune serves it without the client knowing.

An adapter's identity in the prefix keys is the one the workers' KV events carry: the digest of
its weights and config for kvserve workers (learned from their events, which name the adapter
beside its digest), else the sha256 of its name (vLLM keys by name). Either way a block cached
under one adapter never keys as another's or as the base model's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Self

from kvserve.kvevents.wire import adapter_name_digest

AFFINITY_ACTIVE = 1.0
"""The adapter runs on this worker now: no load, and it batches with the running ones."""
AFFINITY_FREE_SLOT = 0.8
"""A slot is free here: one load, and nothing waits for a slot."""
AFFINITY_WAITING = 0.6
"""Requests of this adapter wait here (for a slot): it will load here soon, once."""
AFFINITY_ELSEWHERE = 0.0
"""Every slot here runs other adapters: the request waits for one, then evicts an adapter."""


def parse_tenant_adapters(specs: Sequence[str]) -> dict[str, str]:
    """`TENANT=ADAPTER` strings (`--tenant-adapter`, repeatable) as a map. Raises ValueError
    naming the spec with no `=`, an empty side, or a tenant given twice."""
    mapping: dict[str, str] = {}
    for spec in specs:
        tenant, sep, adapter = (part.strip() for part in spec.partition("="))
        if not sep or not tenant or not adapter:
            raise ValueError(f"--tenant-adapter {spec!r}: write TENANT=ADAPTER, e.g. "
                             "finance=finance-lora (the adapter's name as the workers list it)")
        if tenant in mapping and mapping[tenant] != adapter:
            raise ValueError(f"--tenant-adapter maps tenant {tenant!r} twice ({mapping[tenant]!r}"
                             f" and {adapter!r}): give each tenant one adapter")
        mapping[tenant] = adapter
    return mapping


def _names(value: str) -> frozenset[str]:
    return frozenset(name for name in (n.strip() for n in value.split(",")) if name)


@dataclass(frozen=True, slots=True)
class AdapterState:
    """One worker's adapters as its `vllm:lora_requests_info` says (the latest sample): at most
    `max_loras` adapters in a batch, those of running requests and those of waiting ones."""

    max_loras: int
    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()

    @classmethod
    def from_labels(cls, labels: Mapping[str, str]) -> Self | None:
        """From the labels of one `vllm:lora_requests_info` sample (`max_lora`,
        `running_lora_adapters`, `waiting_lora_adapters`: comma-separated names); None when
        `max_lora` is not a positive integer (not a LoRA-serving worker's sample)."""
        max_lora = labels.get("max_lora", "")
        if not max_lora.isdigit() or int(max_lora) < 1:
            return None
        return cls(int(max_lora), _names(labels.get("running_lora_adapters", "")),
                   _names(labels.get("waiting_lora_adapters", "")))

    def affinity(self, adapter: str) -> float:
        """How well this worker takes a request of `adapter`: active (1.0) > a free slot (0.8)
        > waiting here (0.6) > loaded elsewhere only (0.0)."""
        if adapter in self.running:
            return AFFINITY_ACTIVE
        if len(self.running) < self.max_loras:
            return AFFINITY_FREE_SLOT
        if adapter in self.waiting:
            return AFFINITY_WAITING
        return AFFINITY_ELSEWHERE


@dataclass(frozen=True, slots=True)
class RequestAdapter:
    """The adapter a request runs under: its `name` (what the worker is sent as `model`), the
    `base_model` it adapts (the model id in the first block's keys) and its cache `digest`."""

    name: str
    base_model: str
    digest: bytes

    def __post_init__(self) -> None:
        assert len(self.digest) == 32, "an adapter digest is a sha256"


class AdapterCatalog:
    """The operator's tenant map, the adapters each worker lists (name -> its base model), and
    adapters' digests learned from kvserve workers' KV events. Mutated by the fleet on one
    event loop (or by the simulator); `resolve` reads it."""

    def __init__(self, tenant_adapters: Mapping[str, str] | None = None) -> None:
        self.tenant_adapters = dict(tenant_adapters or {})
        self._listed: dict[str, dict[str, str]] = {}  # worker -> adapter name -> base model
        self._digests: dict[str, bytes] = {}  # adapter name -> digest of its weights

    def set_listed(self, worker_id: str, adapters: Mapping[str, str]) -> None:
        """The adapters `worker_id` lists now (name -> base model), replacing what it listed."""
        self._listed[worker_id] = dict(adapters)

    def forget_worker(self, worker_id: str) -> None:
        self._listed.pop(worker_id, None)

    def learn_digest(self, name: str, digest: bytes) -> None:
        """A kvserve worker's events keyed `name`'s blocks by `digest` (the latest wins: a name
        reloaded with other weights keys anew, and old blocks stop counting as hits)."""
        self._digests[name] = digest

    def base_model_of(self, name: str) -> str | None:
        """The base model some worker lists `name` under (None: no worker lists it)."""
        for adapters in self._listed.values():
            if name in adapters:
                return adapters[name]
        return None

    def digest_for(self, name: str) -> bytes:
        """The identity `name`'s blocks are keyed by (class doc)."""
        return self._digests.get(name) or adapter_name_digest(name)

    def resolve(self, model: str | None, tenant: str | None) -> RequestAdapter | None:
        """The request's adapter: the one its `model` names when a worker lists it, else its
        tenant's (`tenant_adapters`), else None (the base model)."""
        base = self.base_model_of(model) if model else None
        if model and base is not None:
            return RequestAdapter(model, base, self.digest_for(model))
        name = self.tenant_adapters.get(tenant) if tenant is not None else None
        if name is None:
            return None
        # The client named the base model (or nothing): its id keys the first block.
        return RequestAdapter(name, model or self.base_model_of(name) or "",
                              self.digest_for(name))
