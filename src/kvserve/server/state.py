"""`ServerState`: what the routes share (settings, the model pool and routing step, the stores,
the gates' state, metrics). Below `api/`: the routes and the generation path import it; `app.py`
builds one and wires the routes to it."""

from __future__ import annotations

from typing import Protocol

from kvserve.model.numerics import init_math_libraries
from kvserve.server.gates.admission import Admission
from kvserve.server.gates.moderation import ModerationService
from kvserve.server.metrics import ServerMetrics
from kvserve.server.routing.cache_scope import CacheScope
from kvserve.server.routing.pool import ModelPool
from kvserve.server.routing.step import RoutingStep
from kvserve.server.settings import ServerSettings
from kvserve.server.stores.counters import CountersCollector
from kvserve.server.stores.factory import open_backends


class Waker(Protocol):
    """The batch runner as the routes see it (api/batch_runner.py): told when there is work."""

    def wake(self) -> None: ...


class ServerState:
    """What the routes share: settings, the model pool and routing step (routing/), the stores
    (stores/), the gates' state (admission, moderation), metrics."""

    def __init__(self, engine, settings: ServerSettings):
        self.settings = settings
        self.pool = ModelPool(settings, engine=engine)
        self.backends = open_backends(settings)   # keys, buckets, counters, conversations (stores/)
        self.keystore = self.backends.keys
        self.limiter = self.backends.limiter
        self.cache_scope = CacheScope(settings.prefix_cache_scope, settings.shared_prompts)
        self.admission = Admission(settings)
        self.http_ns = 0    # generations' time on the event loop (stages, rendering, writes): generation/run.py
        self.metrics = ServerMetrics(self.engine_stats, lambda: self.model_name or "", self.all_engine_stats)
        self.metrics.gateway_waiting.set_function(lambda: self.admission.num_waiting)
        self.metrics.registry.register(CountersCollector(self.backends.counters))
        self.pool.residency.bind_metrics(self.metrics.registry)   # on-demand loads and unloads
        self.moderation = ModerationService(settings.moderation_config(), settings.db_path, self.metrics.registry,
                                            policies=self.backends.policies)
        if settings.load_model:    # before the model and the encoder load in threads of their own
            init_math_libraries()
        self.routing = RoutingStep.create(settings, self.pool, self.admission, self.metrics.registry)    # encoder, semantic cache, model router (routing/)
        self.batch_runner: Waker | None = None   # the Batch API's lines (started with the app)

    # The default (first) model, as the single-model server had it.
    @property
    def engine(self):
        return self.pool.default.engine

    @property
    def model_name(self) -> str | None:
        return self.pool.default.name if self.engine is not None else None

    @property
    def load_error(self) -> str | None:
        return next((e.load_error for e in self.pool.pinned() if e.load_error), None)

    @property
    def engine_restarts(self) -> int:
        return sum(e.restarts for e in self.pool.entries)

    @property
    def on_load_failed(self):
        return self.pool.on_load_failed

    @on_load_failed.setter
    def on_load_failed(self, fn) -> None:   # set by `kvserve serve`: stop the server, exit non-zero
        self.pool.on_load_failed = fn

    def engine_stats(self, name: str | None = None) -> dict | None:
        """A model's engine stats (default: the first model's), its step profile (`phase_seconds`)
        completed with the two phases that run on this server's event loop: `output` (the engine
        client's output processing: detokenization, stop strings, RequestOutputs) and `http`
        (stages, SSE/JSON formatting and the socket writes; counted for the server as a whole)."""
        engine = self.pool.entry(name).engine if name else self.engine
        if engine is None:
            return None
        stats = engine.stats()
        stats["phase_seconds"] = {**(stats.get("phase_seconds") or {}),
                                  "output": engine.outputs.process_ns / 1e9, "http": self.http_ns / 1e9}
        return stats

    def all_engine_stats(self) -> dict[str, dict]:
        """{served name: engine_stats} of every loaded model (the metrics' engine gauges and counters)."""
        out = {e.name: self.engine_stats(e.name) or {} for e in self.pool.loaded()}
        for name, stats in out.items():      # the event loop's `http` time once, on the default model
            if name != self.model_name:
                stats.get("phase_seconds", {}).pop("http", None)
        return out

    def require_engine(self, requested: str | None, caller: str | None = None):
        """(engine, served name) for a request's `model`: the pool's `resolve` (404 / 503)."""
        return self.pool.resolve(requested, caller)

    def load(self) -> None:
        """Runs in a background thread: build every model's engine client (blocking), then start it.
        The client is the only handle on an engine: in this process or in its own (--engine-process)."""
        self.pool.loop = self.loop
        self.pool.load()
