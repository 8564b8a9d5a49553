"""The adapters a worker knows, by name: registered, loaded into host memory, counted.

A name maps to a path and the digest of what was there when it was registered (vLLM's
`--lora-modules` and `/v1/load_lora_adapter`). At most `max_cpu_loras` adapters stay in host
memory, least recently used first; one evicted from it is read again from its path when a step
needs it, and refused if the files changed since (reload it under its name to serve the new
weights: that is a new digest, so new KV chains). The device slots (model.lora.AdapterSlots)
sit under it, at most `max_loras`.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from kvserve.engine.lora import AdapterRef
from kvserve.model.config import ModelConfig
from kvserve.model.lora import AdapterSlots, LoRAWeights, load_peft_adapter

MAX_LABELLED_ADAPTERS = 64
"""Adapters counted under their own metric label; the rest share the label "other"."""

OTHER_LABEL = "other"


class UnknownAdapter(LookupError):
    """A name this worker has no adapter (or model) for."""


@dataclass(frozen=True, slots=True)
class AdapterEntry:
    """One registered adapter: `ref` (name, id, digest) and where its files are."""

    ref: AdapterRef
    path: str
    base_model_name: str | None
    rank: int


class LoRARegistry:
    """Names -> adapters, and the host-memory LRU of their weights. Thread-safe: the server's
    routes register and resolve on the event loop while the engine thread reads weights."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_rank: int,
                 max_cpu_loras: int) -> None:
        self.config, self.dtype, self.max_rank = config, dtype, max_rank
        self.max_cpu_loras = max_cpu_loras
        self.entries: dict[str, AdapterEntry] = {}
        self._paths: dict[bytes, str] = {}  # digest -> a path that held it (for reloads)
        self._host: OrderedDict[bytes, LoRAWeights] = OrderedDict()  # LRU first
        self._next_id = 1
        self._lock = threading.Lock()
        self.loads: Counter[str] = Counter()  # label -> loads into a device slot
        self.evictions: Counter[str] = Counter()  # label -> evictions from a device slot
        self.host_evictions: Counter[str] = Counter()  # label -> evictions from host memory
        self.rows: Counter[str] = Counter()  # label -> rows (tokens) computed under it
        self._labels: dict[str, str] = {}
        self.slots: AdapterSlots | None = None  # the device slots under it (lora_setup)

    def add(self, name: str, path: str, *, int_id: int | None = None,
            base_model_name: str | None = None, replace: bool = False) -> AdapterEntry:
        """Register `name` for the adapter at `path` (read and checked now: LoRAFormatError
        names what is wrong). A name already registered is refused unless `replace`."""
        if name in self.entries and not replace:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        weights = load_peft_adapter(path, self.config, self.max_rank, self.dtype)
        with self._lock:
            if int_id is None:
                int_id = self._next_id
            self._next_id = max(self._next_id, int_id) + 1
            entry = AdapterEntry(AdapterRef(name, int_id, weights.digest), str(path),
                                 base_model_name, weights.rank)
            self.entries[name] = entry
            self._paths[weights.digest] = str(path)
            self._keep(weights)
        return entry

    def remove(self, name: str) -> AdapterEntry:
        """Forget `name` (requests already running with it finish with its weights)."""
        with self._lock:
            entry = self.entries.pop(name, None)
        if entry is None:
            raise UnknownAdapter(f"The lora adapter '{name}' cannot be found.")
        return entry

    def get(self, name: str) -> AdapterEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise UnknownAdapter(f"The lora adapter '{name}' cannot be found.")
        return entry

    def resolve_request(self, name: str, path: str, int_id: int,
                        base_model_name: str | None = None) -> AdapterRef:
        """The offline API's `LoRARequest`: the registered adapter of that name and path, else
        `path` registered (again) under `name`."""
        entry = self.entries.get(name)
        if entry is not None and (not path or entry.path == path):
            return entry.ref
        if not path:
            raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded and the request gives "
                                 "no lora_path to load it from")
        return self.add(name, path, int_id=int_id, base_model_name=base_model_name,
                        replace=True).ref

    def weights(self, ref: AdapterRef) -> LoRAWeights:
        """The adapter's weights (engine thread): from host memory, else read again from its
        path; a ValueError when the files there no longer have its digest."""
        with self._lock:
            found = self._host.get(ref.digest)
            if found is not None:
                self._host.move_to_end(ref.digest)
                return found
            path = self._paths[ref.digest]
        weights = load_peft_adapter(path, self.config, self.max_rank, self.dtype)
        if weights.digest != ref.digest:
            raise ValueError(f"LoRA adapter {ref.name!r}: the files at {path} changed since it "
                             "was loaded; load it again (/v1/load_lora_adapter) to serve them")
        with self._lock:
            self._keep(weights)
        return weights

    def label(self, name: str) -> str:
        """The metric label of an adapter name: itself for the first MAX_LABELLED_ADAPTERS
        names seen, "other" after, so a stream of new names cannot grow the metrics."""
        label = self._labels.get(name)
        if label is None:
            label = name if len(self._labels) < MAX_LABELLED_ADAPTERS else OTHER_LABEL
            self._labels[name] = label
        return label

    def name_of(self, digest: bytes) -> str:
        return next((e.ref.name for e in self.entries.values() if e.ref.digest == digest),
                    digest.hex()[:12])

    def count_load(self, digest: bytes) -> None:
        self.loads[self.label(self.name_of(digest))] += 1

    def count_eviction(self, digest: bytes) -> None:
        self.evictions[self.label(self.name_of(digest))] += 1

    def count_rows(self, name: str, rows: int) -> None:
        self.rows[self.label(name)] += rows

    def _keep(self, weights: LoRAWeights) -> None:
        """Put `weights` in host memory (most recent), evicting past `max_cpu_loras`."""
        self._host[weights.digest] = weights
        self._host.move_to_end(weights.digest)
        while len(self._host) > self.max_cpu_loras:
            digest, _ = self._host.popitem(last=False)
            self.host_evictions[self.label(self.name_of(digest))] += 1
