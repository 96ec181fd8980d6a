"""Models on demand: which of the pool's models are resident, loaded at first use, unloaded when idle.

Models found in `--models-dir` (each `.gguf` file, each Hugging Face directory) and config entries
with `"on_demand": true` are ModelPool entries like any other, except that none loads at start.
`Residency` owns their life; every change happens on the server's event loop:

* `acquire(entry)` (the plan builder, once per generation) loads the model when it is not resident
  and holds it until the lease's end: a held model is never unloaded. Requests for a model that is
  loading wait for that same load (one load, however many wait); a wait longer than
  `model_load_timeout_s` is a 503 with Retry-After while the load goes on.
* Loads run one at a time, in a thread (the pool's `load_entry`). Before one starts, the least
  recently used idle models are unloaded until the resident models plus the new one fit in the
  memory budget (a model's size: its weight files plus its KV cache budget). When the held models
  leave no room, the load waits for a release; when nothing on demand is resident, it loads anyway.
* A model released by its last request expires `keep_alive` later: the server's default, or the
  longest keep_alive a request asked for since it loaded (Ollama's `keep_alive`: "5m", seconds;
  finite, and at most `--keep-alive-max`: a negative one, "forever", is that maximum). A key's
  request may lengthen a model's keep_alive, never shorten it: other keys may be using it. Only a
  caller that manages the server's models (`gates/auth.py`'s `manages_models`: the --api-key, or
  a server without keys) sets it outright, 0 included (unload at once).
  A reaper task unloads expired idle models.
* A load that fails is not tried again for `LOAD_BACKOFF_S` (the requests naming the model get
  the same error at once, and no idle model is evicted for it); its message carries no path.
* Models given with `--model` (or a config entry without `on_demand`) are pinned: loaded at start,
  never unloaded, counted in the budget.

`ModelPool.statuses()` is what /v1/models and Ollama's /api/ps read: `ModelStatus` per model.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import gc
import logging
import math
import os
import pathlib
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvserve.errors import InvalidRequest, KVServeError, ModelLoadError, Overloaded

if TYPE_CHECKING:
    from kvserve.server.routing.model_entry import ModelEntry

logger = logging.getLogger("kvserve.server")
LOAD_BUCKETS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)
_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt")
# The keep_alive of the request being handled (an Ollama route sets it before the plan is built;
# None: the server's default), read when the request takes its hold.
REQUEST_KEEP_ALIVE: contextvars.ContextVar[float | None] = contextvars.ContextVar("keep_alive", default=None)
# Whether that request may set a model's keep_alive outright (shorten it, 0: unload now).
REQUEST_MANAGES: contextvars.ContextVar[bool] = contextvars.ContextVar("keep_alive_manager", default=False)
LOAD_BACKOFF_S = 30.0     # a model whose load failed is not tried again before this
_ABS_PATH = re.compile(r"(?<![\w.])/(?:[^\s'\"/:]+/)+([^\s'\":]+)")


class Models(Protocol):
    """The pool as residency sees it (routing/pool.py's `ModelPool`)."""

    entries: list[ModelEntry]

    def loaded(self) -> list[ModelEntry]: ...

    def load_entry(self, e: ModelEntry) -> bool: ...


class PermissionDenied(KVServeError, status=403, type="permission_error", code="permission_denied"):
    """The caller's key may not do this to a model other keys share (HTTP 403)."""


def without_paths(message: str) -> str:
    """A message for a client: every absolute path cut to its last part (the server's layout,
    user name and mounts are not the client's business)."""
    return _ABS_PATH.sub(lambda m: m.group(1), message)


def parse_keep_alive(value: Any, param: str = "keep_alive", maximum: float | None = None) -> float | None:
    """Ollama's keep_alive as seconds: a number of seconds or a Go duration ("5m", "1h30m", "300ms");
    negative: forever (-1.0 here; `maximum` when one is given); None/"": unset (None). NaN and
    infinity are a 400; past `maximum` (a request's, the server's --keep-alive-max) it is clamped."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        if re.fullmatch(r"\d+(\.\d+)?", body):
            seconds = sign * float(body)
        elif (parts := _DURATION.findall(body)) and "".join(n + u for n, u in parts) == body:
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
        else:
            raise InvalidRequest(f'{param} must be seconds or a duration such as "5m" or "1h", got {value!r}.',
                                 param=param)
    else:
        raise InvalidRequest(f"{param} must be a number of seconds or a duration string.", param=param)
    if not math.isfinite(seconds):
        raise InvalidRequest(f"{param} must be a finite number of seconds, got {value!r}.", param=param)
    if maximum is not None:
        return maximum if seconds < 0 or seconds > maximum else seconds
    return -1.0 if seconds < 0 else seconds


def memory_budget(value: float | str | None) -> int:
    """The budget in bytes: bytes, a size ("8GiB"), a fraction of RAM (0.5); None: 3/4 of the RAM
    available now."""
    if value is None or value == "":
        return int(0.75 * _available_ram())
    if isinstance(value, str) and re.fullmatch(r"\d+(\.\d+)?", value.strip()):
        value = float(value) if "." in value else int(value)
    if isinstance(value, float) and 0 < value <= 1:
        return int(value * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1:
        return int(value)
    if isinstance(value, str):
        from kvserve.engine.config import parse_bytes

        try:
            return parse_bytes(value)
        except InvalidRequest:
            pass
    raise InvalidRequest(f"--models-memory must be bytes, a size such as 8GiB or a fraction of RAM such as 0.5, "
                         f"got {value!r}", param="models_memory")


def _available_ram() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def scan_models_dir(path: str | pathlib.Path) -> list[tuple[str, str]]:
    """(name, path) of the models in a directory, sorted by name: each `.gguf` file (named by its
    stem) and each subdirectory holding a `config.json` (a Hugging Face model, named by the
    directory) or exactly one `.gguf` file."""
    d = pathlib.Path(path).expanduser()
    if not d.is_dir():
        raise InvalidRequest(f"--models-dir {d}: not a directory", param="models_dir")
    found: list[tuple[str, str]] = []
    for p in sorted(d.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_file() and p.suffix == ".gguf":
            found.append((p.stem, str(p)))
        elif p.is_dir() and ((p / "config.json").is_file() or len(list(p.glob("*.gguf"))) == 1):
            found.append((p.name, str(p)))
    return found


def model_bytes(path: str | None, engine_kwargs: dict) -> int:
    """A model's size for the budget: its weight files plus its KV cache budget."""
    from kvserve.model.registry import resolve

    weights = 0
    with contextlib.suppress(Exception):   # an unreadable path fails at load, with the loader's message
        p = resolve(path).path
        files = [p] if p.is_file() else [f for f in p.iterdir() if f.suffix in WEIGHT_SUFFIXES]
        weights = sum(f.stat().st_size for f in files)
    kv = engine_kwargs.get("kv_cache_memory", "1GiB")
    with contextlib.suppress(Exception):
        from kvserve.engine.config import EngineConfig

        return weights + EngineConfig(kv_cache_memory=kv).kv_cache_bytes()
    return weights


@dataclass
class ModelStatus:
    """One model's residency, as /v1/models and Ollama's /api/ps show it."""

    name: str
    state: str                      # "loaded" | "loading" | "unloaded"
    pinned: bool                    # from --model: resident for the server's life
    size_bytes: int                 # weight files + KV cache budget (what the memory budget counts)
    in_flight: int                  # requests holding it
    expires_at: float | None        # epoch seconds it unloads at if idle until then; None: never / not loaded
    loaded_at: float | None
    path: str | None


class Hold:
    """A request's hold on its model (released once; a pinned model's hold is a no-op)."""

    __slots__ = ("_entry", "_residency")

    def __init__(self, residency: Residency | None = None, entry: ModelEntry | None = None):
        self._residency, self._entry = residency, entry

    def release(self) -> None:
        if self._entry is not None and self._residency is not None:
            entry, self._entry = self._entry, None
            self._residency.release(entry)


class Residency:
    """Loads, holds, expiry and eviction of a pool's on-demand models (see the module docstring)."""

    def __init__(self, pool: Models, settings):
        self.pool = pool
        self.budget = memory_budget(settings.models_memory)
        self.keep_alive_s = float(settings.keep_alive_s)
        self.load_timeout_s = float(settings.model_load_timeout_s)
        self._load_lock = asyncio.Lock()
        self._released = asyncio.Event()
        self._reaper: asyncio.Task | None = None
        self.loads = self.unloads = self.load_seconds = None

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        self.loads = Counter("kvserve:model_loads", "On-demand model loads, by model.", ["model_name"],
                             registry=registry)
        self.unloads = Counter("kvserve:model_unloads", "On-demand model unloads, by model and reason (expired: "
                               "keep_alive passed; evicted: room for another; request: keep_alive 0).",
                               ["model_name", "reason"], registry=registry)
        self.load_seconds = Histogram("kvserve:model_load_seconds", "Seconds an on-demand model took to load.",
                                      ["model_name"], buckets=LOAD_BUCKETS, registry=registry)
        loaded = Gauge("kvserve:models_loaded", "Models resident (pinned and on demand).", registry=registry)
        loaded.set_function(lambda: len(self.pool.loaded()))

    # ---- holds --------------------------------------------------------------------------
    async def acquire(self, e: ModelEntry) -> Hold:
        """Hold `e` for one request, loading it first when it is not resident (waits up to the load
        timeout, then 503 with Retry-After; the load goes on)."""
        if not e.spec.on_demand:
            return Hold()
        self.ask_keep_alive(e, REQUEST_KEEP_ALIVE.get(), REQUEST_MANAGES.get())
        if e.engine is None and e.failed_at and time.monotonic() - e.failed_at < LOAD_BACKOFF_S:
            raise Overloaded(f"The model {e.name} failed to load: {e.load_error}; it is tried again "
                             f"{LOAD_BACKOFF_S:.0f} s after the failure.", retry_after=LOAD_BACKOFF_S,
                             code="model_load_error")
        e.holds += 1
        hold = Hold(self, e)
        try:
            if e.engine is None:
                await asyncio.wait_for(asyncio.shield(self.start_load(e)), self.load_timeout_s)
        except TimeoutError:
            hold.release()
            raise Overloaded(f"The model {e.name} is still loading; retry in a few seconds.",
                             retry_after=5.0, code="model_not_ready") from None
        except BaseException:
            hold.release()
            raise
        e.last_used = time.monotonic()
        return hold

    def ask_keep_alive(self, e: ModelEntry, seconds: float | None, manages: bool) -> None:
        """A request's keep_alive for `e` (None: none asked): a manager's is set outright; anyone
        else's only lengthens what the model has (the server's default, or a longer one asked)."""
        if seconds is None:
            return
        if manages:
            e.keep_alive = seconds
            return
        current = self.keep_alive_s if e.keep_alive is None else e.keep_alive
        if current >= 0 and seconds > current:
            e.keep_alive = seconds

    def release(self, e: ModelEntry) -> None:
        e.holds = max(0, e.holds - 1)
        e.last_used = time.monotonic()
        if e.holds == 0 and e.engine is not None:
            ka = self.keep_alive_s if e.keep_alive is None else e.keep_alive
            e.expires_at = None if ka < 0 else time.time() + ka
            if ka == 0:
                asyncio.get_running_loop().create_task(self.unload(e, "request"))
        self._released.set()


    # ---- loading ------------------------------------------------------------------------
    def start_load(self, e: ModelEntry) -> asyncio.Future:
        """The load of `e` in progress, started if none is (call on the event loop)."""
        if e.loading is None:
            e.loading = asyncio.ensure_future(self._load(e))
            e.loading.add_done_callback(lambda f: f.cancelled() or f.exception())   # retrieved: no warning
        return e.loading

    async def _load(self, e: ModelEntry) -> None:
        try:
            async with self._load_lock:
                if e.engine is not None:
                    return
                await self._make_room(e)
                if e.holds == 0:   # everyone who asked for it gave up waiting
                    logger.info("load of model %s cancelled: no request waits for it any more", e.name)
                    return
                e.load_error, e.failed_at = None, 0.0
                t0 = time.perf_counter()
                if not await asyncio.to_thread(self.pool.load_entry, e):
                    e.failed_at = time.monotonic()
                    raise ModelLoadError(f"The model {e.name} could not be loaded: {e.load_error}")
                seconds = time.perf_counter() - t0
                e.loaded_at, e.last_used = time.time(), time.monotonic()
                if e.holds == 0:
                    self.release_idle(e)
                if self.loads is not None:
                    self.loads.labels(e.name).inc()
                    self.load_seconds.labels(e.name).observe(seconds)
                logger.info("model %s loaded on demand in %.1f s (%.0f MiB of the %.0f MiB budget in use)", e.name,
                            seconds, self.resident_bytes() / 2**20, self.budget / 2**20)
        finally:
            e.loading = None

    def release_idle(self, e: ModelEntry) -> None:
        """Start the expiry clock of a model no request holds (a load nobody waited for to the end)."""
        e.holds += 1
        self.release(e)

    def resident_bytes(self) -> int:
        return sum(x.size_bytes for x in self.pool.loaded())

    async def _make_room(self, e: ModelEntry) -> None:
        while self.resident_bytes() + e.size_bytes > self.budget:
            idle = [x for x in self.pool.loaded() if x.spec.on_demand and x.holds == 0 and x is not e]
            if idle:
                await self.unload(min(idle, key=lambda x: x.last_used), "evicted")
                continue
            if not any(x.spec.on_demand for x in self.pool.loaded()):
                logger.warning("model %s (%.0f MiB) does not fit in the models' memory budget (%.0f MiB) beside "
                               "the pinned models; loading it anyway", e.name, e.size_bytes / 2**20,
                               self.budget / 2**20)
                return
            if e.holds == 0:    # nobody waits for this load any more: drop it
                raise ModelLoadError(f"The load of {e.name} was given up: no request waits for it.")
            self._released.clear()          # every resident model is in use: wait for a release
            with contextlib.suppress(TimeoutError):   # re-check who waits at least every few seconds
                await asyncio.wait_for(self._released.wait(), 2.0)

    async def unload(self, e: ModelEntry, reason: str) -> bool:
        """Unload `e` if it is resident, on demand and idle; True when it was."""
        engine = e.engine
        if engine is None or e.holds or not e.spec.on_demand:
            return False
        e.engine, e.expires_at, e.loaded_at, e.keep_alive = None, None, None, None
        with contextlib.suppress(Exception):
            await engine.shutdown()
        del engine
        await asyncio.to_thread(_give_back_memory)
        if self.unloads is not None:
            self.unloads.labels(e.name, reason).inc()
        logger.info("model %s unloaded (%s)", e.name, reason)
        self._released.set()
        return True

    # ---- expiry -------------------------------------------------------------------------
    def start(self) -> None:
        if self._reaper is None and any(e.spec.on_demand for e in self.pool.entries):
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None

    async def _reap(self, every_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            now = time.time()
            for e in self.pool.loaded():
                if e.spec.on_demand and e.holds == 0 and e.expires_at is not None and e.expires_at <= now:
                    try:
                        await self.unload(e, "expired")
                    except Exception:
                        logger.exception("unloading model %s failed", e.name)

    def status(self, e: ModelEntry) -> ModelStatus:
        state = "loaded" if e.engine is not None else "loading" if e.loading is not None else "unloaded"
        expires = e.expires_at
        if e.engine is not None and e.spec.on_demand and e.holds:   # in use: the clock starts at its release
            ka = self.keep_alive_s if e.keep_alive is None else e.keep_alive
            expires = None if ka < 0 else time.time() + ka
        return ModelStatus(name=e.name or "", state=state, pinned=not e.spec.on_demand, size_bytes=e.size_bytes,
                           in_flight=e.holds, expires_at=expires if e.spec.on_demand else None,
                           loaded_at=e.loaded_at, path=e.spec.path)


def _give_back_memory() -> None:
    """Collect the unloaded model's objects and hand freed heap pages back to the system."""
    gc.collect()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
