"""The server's models: a pool of named engine clients, and `resolve(name)`.

A server serves one or more generative models, each behind its own EngineClient (in this process,
in its own process, or any other kind that speaks the EngineClient interface) with its own KV
budget. `ModelPool.resolve(name)` is the one place where the `model` a client sent becomes an
engine: None or "" is the default (first) model, an unknown name is a 404 `model_not_found`, a
model still loading (or reloading after its engine process died) a 503 with Retry-After. Aliases
(a model's own name beside its served name) and future kinds of names (adapters with a `parent`)
plug in here, as extra entries or as a lookup before the 404.

Models are described by `ModelSpec`s: from `--model NAME=PATH` (repeatable), or from a config file
(JSON or TOML: `{"models": [{"name", "path", "kv_cache_memory", "cost_per_1k_tokens",
"engine_process", ...}], "router": {...}}`), or, with neither, the single model of the settings.
Engine options (max_model_len, kv_cache_memory, ...) given on the command line apply to every
model; a spec's own `engine` options override them. Models on demand (`--models-dir`, or entries
with `"on_demand": true`) are entries too, loaded at first use and unloaded when idle: residency.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import pathlib
import threading
import time
import tomllib

from kvserve.errors import InvalidRequest, KVServeError, ModelNotFound, Overloaded
from kvserve.server.routing.model_entry import ModelEntry, ModelSpec
from kvserve.server.routing.residency import (
    REQUEST_KEEP_ALIVE,
    REQUEST_MANAGES,
    Hold,
    ModelStatus,
    PermissionDenied,
    Residency,
    memory_budget,
    model_bytes,
    parse_keep_alive,
    scan_models_dir,
    without_paths,
)

logger = logging.getLogger("kvserve.server")
SCAN_EVERY_S = 2.0    # --models-dir is scanned for an unknown name at most this often


def read_config(path: str | pathlib.Path) -> dict:
    """The models config file (JSON, or TOML by its suffix) as a dict; a clear error when bad."""
    p = pathlib.Path(path)
    try:
        text = p.read_text()
        data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except OSError as e:
        raise InvalidRequest(f"--models-config {p}: {e.strerror}", param="models_config") from None
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise InvalidRequest(f"--models-config {p}: not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}",
                             param="models_config") from None
    if not isinstance(data, dict) or not isinstance(data.get("models", []), list):
        raise InvalidRequest(f"--models-config {p}: expected {{\"models\": [...]}}", param="models_config")
    return data


def model_options(values: list[str], config: str | pathlib.Path | None, models_dir: str | None = None,
                  models_memory: str | None = None, keep_alive: str | None = None) -> tuple[list, dict | None, dict, dict]:
    """`kvserve serve`'s model options: the ModelSpecs of `--model` (repeatable) and `--models-config`,
    the router and semantic-cache config, and the ServerSettings fields of the models on demand
    (`--models-dir`, `--models-memory`, `--keep-alive`, or the config's top-level keys of those names
    in snake case, the options winning; and the config's `model_load_timeout`, seconds)."""
    specs = [ModelSpec.parse(v) for v in values]
    router, cache, data = None, {}, {}
    if config is not None:
        data = read_config(config)
        specs += [ModelSpec.from_dict(d) for d in data.get("models", [])]
        router = data.get("router")
        cache = data.get("semantic_cache") or {}
    on_demand = {"models_dir": models_dir or data.get("models_dir"),
                 "models_memory": models_memory or data.get("models_memory")}
    if on_demand["models_dir"]:
        scan_models_dir(on_demand["models_dir"])          # a missing directory fails now
    if on_demand["models_memory"] is not None:
        memory_budget(on_demand["models_memory"])         # so does a bad size
    seconds = parse_keep_alive(keep_alive if keep_alive is not None else data.get("keep_alive"), "--keep-alive")
    if seconds is not None:
        on_demand["keep_alive_s"] = seconds
    if data.get("model_load_timeout") is not None:   # how long a request waits for its model's load
        on_demand["model_load_timeout_s"] = float(data["model_load_timeout"])
    if not specs and not on_demand["models_dir"]:
        specs = [ModelSpec(name=None, path=None)]
    return specs, router, cache, on_demand


class ModelPool:
    """Named engine clients. Agnostic of the client kind: it calls `make_engine_client`-like
    factories, `start()`, `shutdown()`, `health()` and reads `model_name`/`max_model_len`."""

    def __init__(self, settings, specs: list[ModelSpec] | None = None, engine=None):
        self.settings = settings
        self.models_dir = getattr(settings, "models_dir", None)
        specs = specs or list(getattr(settings, "models", None) or []) or \
            ([] if self.models_dir and settings.model is None else
             [ModelSpec(name=settings.served_model_name, path=settings.model)])
        names = [s.name for s in specs if s.name]
        if len(set(names)) != len(names):
            raise InvalidRequest(f"two models share a name: {sorted(names)}", param="model")
        self._sized = bool(self.models_dir) or any(s.on_demand for s in specs)   # a memory budget applies
        self.entries = [self._entry(s) for s in specs]
        self.residency = Residency(self, settings)
        if self.models_dir:
            self.scan()
            if not self.entries:
                raise InvalidRequest(f"--models-dir {self.models_dir} holds no model (.gguf files, Hugging Face "
                                     "directories) and no --model was given", param="models_dir")
        if engine is not None:             # create_app(engine, ...): a prebuilt client for the first model
            self.entries[0].engine = engine
            self.entries[0].name = self.entries[0].name or engine.model_name
        self.on_load_failed = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lora_owners: dict[str, str] = {}   # adapter -> the key it was loaded for (absent: everyone's)
        self._scanned_at = time.monotonic()     # the last --models-dir scan (throttled: SCAN_EVERY_S)

    def _entry(self, spec: ModelSpec) -> ModelEntry:
        kwargs = {**getattr(self.settings, "engine_kwargs", {}), **spec.engine}
        return ModelEntry(spec, name=spec.name, size_bytes=model_bytes(spec.path, kwargs) if self._sized else 0)

    def scan(self) -> list[ModelEntry]:
        """Add the models of --models-dir not yet known (at start, and when a request names a model
        the pool does not know: a file copied in since is served without a restart)."""
        known = {e.name for e in self.entries} | {e.spec.path for e in self.entries}
        try:
            found = scan_models_dir(self.models_dir)
        except InvalidRequest as ex:      # the directory went away: serve what is known
            logger.warning("%s", ex.message)
            return []
        added = [self._entry(ModelSpec(name=name, path=path, on_demand=True))
                 for name, path in found if name not in known and path not in known]
        self.entries += added
        return added

    def pinned(self) -> list[ModelEntry]:
        """The models loaded at start and kept for the server's life (what /health waits for)."""
        return [e for e in self.entries if not e.spec.on_demand]

    # ---- lookups --------------------------------------------------------------------------
    @property
    def default(self) -> ModelEntry:
        return self.entries[0]

    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries if e.engine is not None]

    def names(self) -> list[str]:
        return [e.name for e in self.entries if e.name]

    def entry(self, requested: str | None) -> ModelEntry:
        """The entry `requested` names (None/"": the default); 404 when no model has that name."""
        if requested in (None, ""):
            return self.default
        for e in self.entries:
            if requested == e.name or (e.engine is not None and requested == e.engine.model_name
                                       and not any(o.name == requested for o in self.entries)):
                return e
        for e in self.loaded():       # a LoRA adapter over a model's base (engine/lora.py)
            if requested in e.engine.lora_names():
                return e
        raise self._not_found(requested)

    async def rescan_for(self, requested: str | None) -> None:
        """A name the pool does not know may be a file copied into --models-dir since the last scan:
        scan again, in a worker thread and at most once every SCAN_EVERY_S (a client sending unknown
        names costs one directory listing per interval, never the event loop's time)."""
        if not self.models_dir or requested in (None, "") or requested in self.names():
            return
        now = time.monotonic()
        if now - self._scanned_at < SCAN_EVERY_S:
            return
        self._scanned_at = now
        await asyncio.to_thread(self.scan)

    def _not_found(self, requested: str) -> ModelNotFound:
        served = ", ".join(repr(n) for n in self.names()) or "its model"
        return ModelNotFound(f"The model {requested!r} does not exist on this server; it serves {served} "
                             "(GET /v1/models).", param="model")

    def lora_visible(self, name: str, caller: str | None) -> bool:
        """Whether the caller (a key's name) may list and use adapter `name`: an adapter loaded for
        one key (`kvserve_owner`) is that key's; one from --lora or loaded by the admin for no key
        is everyone's."""
        owner = self.lora_owners.get(name)
        return owner is None or owner == caller

    def resolve(self, requested: str | None, caller: str | None = None):
        """(engine client, served name) for the model a request names; raises 404 / 503 (404 too
        for another key's adapter: it is not there for this caller)."""
        if requested and not self.lora_visible(requested, caller) and requested not in self.names():
            raise self._not_found(requested)
        e = self.entry(requested)
        if e.spec.on_demand:
            e.last_used = time.monotonic()          # looked up: not the least recently used
        if e.engine is None and e.spec.on_demand:     # a lookup loads nothing: only a generation's hold does
            state = "loading" if e.loading is not None else "not loaded"
            raise Overloaded(f"The model {e.name} is {state}; a generation request naming it loads it "
                             "(/tokenize, token counts and lookups never do).", retry_after=5.0,
                             code="model_not_ready")
        if e.engine is None:
            msg = (f"The model {e.name or e.spec.path or 'default'} failed to load: {e.load_error}"
                   if e.load_error else "The model is still loading; retry in a few seconds.")
            raise Overloaded(msg, retry_after=5.0, code="model_not_ready")
        if requested not in (None, "", e.name, e.engine.model_name) and requested in e.engine.lora_names():
            return e.engine.with_lora(requested), requested
        return e.engine, e.name

    async def acquire(self, requested: str | None) -> Hold:
        """Hold the on-demand model a request names for the request's life, loading it first (waits;
        503 with Retry-After past the load timeout). Any other name: a no-op hold (its errors are
        `resolve`'s, raised in their usual place)."""
        await self.rescan_for(requested)
        try:
            e = self.entry(requested)
        except ModelNotFound:
            return Hold()
        return await self.residency.acquire(e)

    def would_load(self, requested: str | None) -> bool:
        """Whether holding `requested` now would start a load (an on-demand model neither resident
        nor loading): what the per-key load limit counts (plan.py's `charge_load`)."""
        try:
            e = self.entry(requested)
        except ModelNotFound:
            return False
        return e.spec.on_demand and e.engine is None and e.loading is None

    async def preload(self, requested: str, keep_alive, manages: bool = True) -> None:
        """Ollama's request with nothing to answer: load the model (keep_alive 0: unload it now, or
        as soon as its requests end: only for a caller that `manages` the models, 403 for any other
        key); a pinned model is only looked up."""
        await self.rescan_for(requested)
        e = self.entry(requested)
        if not e.spec.on_demand:
            self.resolve(requested)
            return
        self.set_keep_alive(keep_alive, manages)
        if REQUEST_KEEP_ALIVE.get() == 0:     # unloaded now, or by the release of its last request
            if not manages:
                raise PermissionDenied("keep_alive 0 unloads a model other keys may be using: only the server's "
                                       "--api-key may do that. Leave keep_alive out to let it expire.")
            if e.engine is not None:          # resident: unloaded now, or when its last request ends
                e.keep_alive = 0.0            # (reset by the unload: the next load starts from the default)
            await self.residency.unload(e, "request")
            return
        (await self.residency.acquire(e)).release()

    def set_keep_alive(self, keep_alive, manages: bool = False) -> None:
        """The keep_alive of the request being handled (Ollama's field; 400 when unreadable or not
        finite; clamped to --keep-alive-max): how long the model on demand it names stays loaded
        after its last request; None: the server's default. `manages`: the caller may shorten it."""
        maximum = float(getattr(self.settings, "keep_alive_max_s", 3600.0))
        REQUEST_KEEP_ALIVE.set(parse_keep_alive(keep_alive, maximum=maximum))
        REQUEST_MANAGES.set(manages)

    def statuses(self, loaded_only: bool = False) -> list[ModelStatus]:
        """Every model's residency (`loaded_only`: the resident ones), in the pool's order."""
        return [self.residency.status(e) for e in self.entries if e.name and (e.engine is not None or not loaded_only)]

    # ---- life cycle -----------------------------------------------------------------------
    def load_entry(self, e: ModelEntry) -> bool:
        """Build one engine client (blocking; runs in a thread) and start it on the server's loop."""
        from kvserve.engine.client import make_engine_client

        s, spec = self.settings, e.spec
        kwargs = {**s.engine_kwargs, **spec.engine}
        try:
            engine = make_engine_client(spec.path, weight_format=spec.weight_format or s.weight_format,
                                        engine_process=s.engine_process if spec.engine_process is None
                                        else spec.engine_process, **kwargs)
        except Exception as ex:
            logger.warning("model %s (%s) failed to load: %s", e.name, spec.path, ex,
                           exc_info=not isinstance(ex, KVServeError))
            message = str(ex) if isinstance(ex, KVServeError) else f"{type(ex).__name__}: {ex}"
            e.load_error = without_paths(message)     # clients see it: no server paths (the log has them)
            return False
        asyncio.run_coroutine_threadsafe(engine.start(), self.loop).result()
        e.name = e.name or engine.model_name
        e.engine = engine
        st = engine.stats()
        kv = (f"; KV cache {st['kv_cache_dtype']}: {st['kv_cache_bytes_per_token']} bytes per token, "
              f"{st['kv_cache_capacity_tokens']} tokens fit" if "kv_cache_capacity_tokens" in st else "")
        logger.info("model %s loaded (%s)%s", e.name, engine.model_name, kv)
        return True

    def load(self) -> None:
        """Runs in a background thread: every model in turn; a failure stops the server (as with
        one model) through `on_load_failed`."""
        for e in self.pinned():
            if e.engine is None and not self.load_entry(e):
                msg = e.load_error if len(self.entries) == 1 else f"{e.spec.name or e.spec.path}: {e.load_error}"
                if self.on_load_failed is not None:
                    self.on_load_failed(msg)
                else:
                    logger.error("model load failed: %s", msg)
                return

    async def start(self) -> None:
        for e in self.loaded():
            await e.engine.start()
        self.residency.start()

    async def shutdown(self) -> None:
        self.residency.stop()
        for e in self.loaded():
            with contextlib.suppress(Exception):
                await e.engine.shutdown()

    async def watch(self, every_s: float = 0.5) -> None:
        """Restart any engine process that died; its model answers 503 until it is back."""
        while True:
            await asyncio.sleep(every_s)
            for e in self.entries:
                engine = e.engine
                if engine is None or getattr(engine, "kind", None) != "process":
                    continue
                try:
                    engine.health()
                    continue
                except KVServeError as ex:
                    message = ex.message
                logger.error("the engine process of %s died (%s); restarting it", e.name, message)
                e.engine = None
                e.restarts += 1
                engine.fail_all(message)
                with contextlib.suppress(Exception):
                    await engine.shutdown()
                threading.Thread(target=self.load_entry, args=(e,), name="kvserve-model-reload",
                                 daemon=True).start()

    def cards(self, created: int, caller: str | None = None, unloaded: bool = False) -> list[dict]:
        """/v1/models entries of the loaded models (and the adapters `caller` may use); with
        `unloaded`, the on-demand models not resident too. An on-demand model's card says
        `kvserve_state`: loaded, loading or unloaded."""
        cards = []
        for e in self.entries:
            if e.engine is None and not (unloaded and e.spec.on_demand and e.name):
                continue
            card = {"id": e.name, "object": "model", "created": created, "owned_by": "kvserve"}
            if e.engine is not None:
                card |= {"max_model_len": e.engine.max_model_len, "cost_per_1k_tokens": e.spec.cost_per_1k_tokens}
            if e.spec.on_demand:
                card["kvserve_state"] = self.residency.status(e).state
            cards.append(card)
        return cards + [
                {"id": n, "object": "model", "created": created, "owned_by": "kvserve", "parent": e.name, "root": n,
                 "max_model_len": e.engine.max_model_len} for e in self.loaded() for n in e.engine.lora_names()
                if self.lora_visible(n, caller)]
