"""The engine's LoRA adapters: which names exist, which are in memory, and each step's groups.

    LoRAManager.add(name, path)   read + check against the base (one-line error), register
    LoRAManager.acquire(name)     the adapter for a new request (loaded again from disk when the
                                  LRU evicted it); the request holds it until it finishes
    LoRAManager.batch(rows)       the step's LoRABatch: each adapter's rows in the flattened batch

At most `max_loras` adapters stay resident in the LRU (least recently requested out first); a
running request keeps its own adapter alive, so eviction never changes a request's weights.
Every loaded copy gets a new `key`, which salts the prefix cache (kv_cache_manager.py): blocks
computed under one adapter, or under an older load of the same name, never serve another.
The server thread (load/unload endpoints) and the core's thread both call in: one lock.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvserve.errors import InvalidRequest, ModelNotFound
from kvserve.model.lora import LoRAAdapter, LoRABatch, load_adapter

logger = logging.getLogger("kvserve.engine")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's shape: an adapter by name (and where to find it, the first time it is used)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None


class LoRAManager:
    def __init__(self, model: torch.nn.Module, max_loras: int = 8, base_names: tuple[str, ...] = ()):
        self.model = model
        self.max_loras = max_loras
        self.base_names = set(base_names)
        self.paths: dict[str, str] = {}
        self.resident: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.lock = threading.Lock()
        self.num_loads = 0
        self.num_evictions = 0

    def names(self) -> list[str]:
        with self.lock:
            return list(self.paths)

    def add(self, name: str, path: str) -> LoRAAdapter:
        """Register and load an adapter; InvalidRequest when it does not fit this base."""
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequest("a LoRA adapter needs a name: NAME=PATH", param="lora_name")
        if name in self.base_names:
            raise InvalidRequest(f"{name!r} is the base model's name; give the adapter another", param="lora_name")
        with self.lock:
            if name in self.paths:
                raise InvalidRequest(f"a LoRA adapter named {name!r} is already loaded; unload it first",
                                     param="lora_name")
        adapter = load_adapter(path, self.model.config, name)
        with self.lock:
            if name in self.paths:
                raise InvalidRequest(f"a LoRA adapter named {name!r} is already loaded; unload it first",
                                     param="lora_name")
            self.paths[name] = str(path)
            self._keep(adapter)
        logger.info("LoRA adapter %s loaded from %s (rank %d, %s; %.1f MB)", name, path, adapter.rank,
                    ",".join(adapter.target_modules), adapter.nbytes / 1e6)
        return adapter

    def remove(self, name: str) -> None:
        with self.lock:
            if name not in self.paths:
                raise ModelNotFound(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
            del self.paths[name]
            self.resident.pop(name, None)

    def acquire(self, name: str) -> LoRAAdapter:
        """The adapter for a new request, marked most recently used (read from disk if evicted)."""
        with self.lock:
            if name not in self.paths:
                raise ModelNotFound(f"The model {name!r} does not exist on this server (GET /v1/models).",
                                    param="model")
            adapter = self.resident.get(name)
            if adapter is not None:
                self.resident.move_to_end(name)
                return adapter
            path = self.paths[name]
        adapter = load_adapter(path, self.model.config, name)
        with self.lock:
            self._keep(adapter)
        return adapter

    def _keep(self, adapter: LoRAAdapter) -> None:
        """Make resident (lock held), evicting the least recently used past max_loras."""
        self.num_loads += 1
        self.resident[adapter.name] = adapter
        self.resident.move_to_end(adapter.name)
        while len(self.resident) > self.max_loras:
            self.resident.popitem(last=False)
            self.num_evictions += 1

    @staticmethod
    def batch(row_adapters: list[tuple[LoRAAdapter | None, int, int]], num_rows: int,
              device: torch.device | str = "cpu") -> LoRABatch | None:
        """(adapter or None, first row, row count) per request of a step -> its LoRABatch, or None
        when no row has an adapter."""
        rows: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        for adapter, start, n in row_adapters:
            if adapter is not None and n:
                rows.setdefault(id(adapter), (adapter, []))[1].extend(range(start, start + n))
        if not rows:
            return None
        groups = [(a, None if len(r) == num_rows else torch.tensor(r, dtype=torch.long, device=device))
                  for a, r in rows.values()]
        return LoRABatch(groups)

    def stats(self) -> dict:
        with self.lock:
            return {"lora_adapters": len(self.paths), "lora_resident": len(self.resident),
                    "lora_loads": self.num_loads, "lora_evictions": self.num_evictions}


def parse_lora_modules(specs: list[str] | dict[str, str] | None) -> dict[str, str]:
    """`--lora NAME=PATH` items (or a dict) -> {name: path}."""
    if not specs:
        return {}
    if isinstance(specs, dict):
        return dict(specs)
    out: dict[str, str] = {}
    for s in specs:
        name, sep, path = s.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise InvalidRequest(f"--lora takes NAME=PATH, got {s!r}", param="lora")
        if name.strip() in out:
            raise InvalidRequest(f"--lora names {name.strip()!r} twice", param="lora")
        out[name.strip()] = path.strip()
    return out
