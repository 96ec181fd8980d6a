"""One served model as the pool and its residency see it: `ModelSpec` (what to load, and how) and
`ModelEntry` (its engine client once loaded, and its on-demand state). Below both pool.py and
residency.py, which share these types."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import InvalidRequest

ENGINE_KEYS = ("max_model_len", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
               "long_prefill_token_threshold", "max_num_partial_prefills", "max_step_ms", "max_decode_slowdown",
               "threads")


@dataclass
class ModelSpec:
    """One served model: a name clients send, what to load, and how."""

    name: str | None                  # None: the engine's own model name
    path: str | None                  # built-in name, .gguf file or HF directory; None: the default model
    engine: dict = field(default_factory=dict)   # EngineConfig overrides (kv_cache_memory, ...)
    engine_process: bool | None = None
    weight_format: str | None = None
    cost_per_1k_tokens: float = 1.0   # for the router and the usage's cost
    on_demand: bool = False           # loaded by the first request naming it, unloaded when idle

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """`NAME=PATH` or `PATH` (the name is then the engine's)."""
        name, sep, path = text.partition("=")
        if not sep:
            return cls(name=None, path=text or None)
        if not name.strip() or not path.strip():
            raise InvalidRequest(f"--model {text!r}: expected NAME=PATH", param="model")
        return cls(name=name.strip(), path=path.strip())

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        if not isinstance(d, dict) or "path" not in d and "name" not in d:
            raise InvalidRequest(f"model entry {d!r}: needs at least name or path", param="models")
        engine = dict(d.get("engine") or {})
        engine.update({k: d[k] for k in ENGINE_KEYS if k in d})
        return cls(name=d.get("name"), path=d.get("path"), engine=engine, engine_process=d.get("engine_process"),
                   weight_format=d.get("weight_format"), cost_per_1k_tokens=float(d.get("cost_per_1k_tokens", 1.0)),
                   on_demand=bool(d.get("on_demand", False)))


@dataclass
class ModelEntry:
    spec: ModelSpec
    engine: Any = None                # an EngineClient once loaded
    name: str | None = None           # the served name (spec.name, or the engine's once loaded)
    load_error: str | None = None
    restarts: int = 0
    size_bytes: int = 0               # weight files + KV cache budget (the models' memory budget counts it)
    # on demand (residency.py): requests holding it, its last use (monotonic), when it unloads if
    # still idle (epoch s), the last request's keep_alive (s; None: the server's), the load running
    holds: int = 0
    last_used: float = 0.0
    expires_at: float | None = None
    loaded_at: float | None = None
    keep_alive: float | None = None
    loading: asyncio.Future | None = None
    failed_at: float = 0.0            # monotonic s of the last failed load (0: none): the retry backoff

    @property
    def cost_per_token(self) -> float:
        return self.spec.cost_per_1k_tokens / 1000.0
