"""AsyncEngine: the bridge from asyncio (the server) to the engine loop in a background thread.

The engine's state is touched only by its own thread: `generate` and `abort` post commands to
a queue that the loop drains before every step, and outputs come back to each request's
asyncio.Queue through `loop.call_soon_threadsafe`. Model compute never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.errors import KVServeError
from kvserve.model.loader import load_model
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


class EngineDeadError(KVServeError):
    status = 500
    type = "server_error"
    code = "engine_error"


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.block_size = engine.block_size
        self._cmds: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stop = False

    @classmethod
    def from_model(cls, model: str | None = None, weight_format: str = "auto", **engine_kwargs) -> AsyncEngine:
        loaded = load_model(model, weight_format=weight_format)
        cfg = EngineConfig(weight_format=weight_format, **engine_kwargs)
        return cls(LLMEngine(loaded.model, loaded.tokenizer, cfg, model_name=loaded.source.name))

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None

    def stats(self) -> dict:
        return self.engine.stats()

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None,
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        fut: Future = Future()
        self._post(("add", fut, request_id, {"prompt": prompt, "prompt_token_ids": prompt_token_ids}, params,
                    priority, cache_salt))
        finished = False
        try:
            await asyncio.wrap_future(fut)            # raises the engine's validation errors
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post(("abort", None, request_id))

    async def abort(self, request_id: str) -> None:
        self._post(("abort", None, request_id))

    # ---- engine thread ------------------------------------------------------------------
    def _post(self, cmd: tuple) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            kind, fut, rid = cmd[0], cmd[1], cmd[2]
            if kind == "add":
                if not fut.set_running_or_notify_cancel():
                    continue  # the caller was cancelled (client gone) before the add: skip it
                try:
                    self.engine.add_request(rid, cmd[3], cmd[4], priority=cmd[5], cache_salt=cmd[6])
                    fut.set_result(None)
                except BaseException as e:  # noqa: BLE001 - handed to the caller's coroutine
                    fut.set_exception(e)
            elif kind == "abort":
                self.engine.abort(rid)

    def _loop(self) -> None:
        while not self._stop:
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
                err = EngineDeadError(f"the engine failed while running this request: {e!r}")
                for rid in list(self.engine.requests):
                    self.engine.abort(rid)
                    self._deliver(rid, err)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
