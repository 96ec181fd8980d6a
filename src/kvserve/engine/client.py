"""EngineClient: the server's handle on an engine, the same interface whether the EngineCore runs
in a thread of this process or in a process of its own.

    generate(prompt_token_ids, params, request_id, ...) -> async stream of RequestOutputs
    abort(request_id), stats(), health(), start(), shutdown()

The client does the request's text work on the event loop (kvserve.engine.processing: validation,
n/best_of fan-out, detokenization, stop strings, logprobs) and sends only typed messages to the
core: EngineCoreRequest / AbortRequests in, EngineCoreOutputs back.

* InprocClient: the core's busy loop in a thread; messages go through a queue, outputs come back
  with `loop.call_soon_threadsafe`. Model compute never blocks the event loop.
* MPClient: the core in `python -m kvserve.engine.process`, msgpack over two local ZMQ sockets
  (PUSH requests, PULL outputs). The model is loaded once, in the engine process, which sends the
  tokenizer back in its first message. The HTTP process stays responsive while the model computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable

from kvserve.engine.messages import (
    AbortRequests,
    CoreInput,
    EngineCoreOutputs,
    EngineFailed,
    EngineReady,
    Shutdown,
    decode_output,
    encode,
)
from kvserve.engine.processing import EngineInfo, InputProcessor, OutputProcessor
from kvserve.errors import InvalidRequest, KVServeError, ModelLoadError, ModelNotFound
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


class EngineDeadError(KVServeError):
    """The engine stopped (its process died): 503 with Retry-After, as the server restarts it."""

    status = 503
    type = "server_error"
    code = "engine_error"
    retry_after = 5.0


class EngineClient:
    """Shared by both transports; a subclass provides `_send(messages)` and the delivery of
    EngineCoreOutputs to `_on_outputs` on the event loop."""

    kind = ""

    def __init__(self, tokenizer, info: EngineInfo, enable_prefix_caching: bool = True):
        self.tokenizer = tokenizer
        self.info = info
        self.inputs = InputProcessor(tokenizer, info, enable_prefix_caching)
        self.outputs = OutputProcessor(tokenizer)
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats: dict = {}
        self._dead: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lora_names: list[str] = []

    # ---- the interface ----------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def block_size(self) -> int:
        return self.info.block_size

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        from kvserve.structured.grammar import available
        if available():    # the first structured request should not pay for imports and setup
            threading.Thread(target=self.inputs.grammar_compiler().warm_up, daemon=True,
                             name="kvserve-grammar-warmup").start()

    async def shutdown(self) -> None:
        raise NotImplementedError

    def stats(self) -> dict:
        return dict(self._stats)

    def health(self) -> None:
        """Raises EngineDeadError when the engine can no longer serve."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None, cache_salt_from: int = 0,
                       prompt: str | None = None, lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        self.health()
        if request_id in self.outputs.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        if lora_name is not None and lora_name not in self.lora_names():
            raise ModelNotFound(f"The model {lora_name!r} does not exist on this server (GET /v1/models).",
                                param="model")
        reqs = self.inputs.requests(request_id, list(prompt_token_ids), params, priority=priority,
                                    cache_salt=cache_salt, cache_salt_from=cache_salt_from, lora_name=lora_name)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self.outputs.add(request_id, prompt, reqs)
        self._send(reqs)
        finished = False
        try:
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
            self._queues.pop(request_id, None)
            if not finished:
                self._abort(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    # ---- LoRA adapters (engine/lora.py) -----------------------------------------------------
    def lora_names(self) -> list[str]:
        """The adapters a request may name in "model"."""
        return list(self._lora_names)

    def add_lora(self, name: str, path: str) -> None:
        """Load an adapter at run time (blocking: reads and checks the files)."""
        raise InvalidRequest("adapters cannot be loaded at run time into an engine process; start the server "
                             "with --lora NAME=PATH, or without --engine-process", param="lora_name")

    def remove_lora(self, name: str) -> None:
        raise InvalidRequest("adapters cannot be unloaded at run time from an engine process", param="lora_name")

    def with_lora(self, name: str) -> LoRAClient:
        """This client with every request run under adapter `name` (the server's routing step)."""
        return LoRAClient(self, name)

    # ---- shared machinery -------------------------------------------------------------------
    def _send(self, msgs: list[CoreInput]) -> None:
        raise NotImplementedError

    def _abort(self, request_id: str) -> None:
        ids = self.outputs.core_ids(request_id)
        self.outputs.abort(request_id)
        if ids and self._dead is None:
            self._send([AbortRequests(ids)])

    def _on_outputs(self, outs: EngineCoreOutputs) -> None:
        """On the event loop: core outputs -> RequestOutputs -> each request's queue."""
        if outs.stats is not None:
            self._stats = outs.stats
        results, to_abort = self.outputs.process(outs)
        if to_abort:
            self._send([AbortRequests(to_abort)])
        for r in results:
            q = self._queues.get(r.request_id)
            if q is not None:
                q.put_nowait(r if r.error is None else EngineDeadError(r.error))

    def _call_soon(self, fn: Callable, *args) -> None:
        """From the engine's thread: run fn on the event loop the client was last started on."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):   # the loop closed under us: nobody is listening
                loop.call_soon_threadsafe(fn, *args)

    def fail_all(self, message: str) -> None:
        """Mark the engine dead and end every waiting request with EngineDeadError (event loop)."""
        self._fail_all(message)

    def _fail_all(self, message: str) -> None:
        """On the event loop: the engine is gone; every waiting request gets the error."""
        self._dead = message
        for rid, q in list(self._queues.items()):
            self.outputs.abort(rid)
            q.put_nowait(EngineDeadError(message))


class LoRAClient:
    """An EngineClient whose requests run under one LoRA adapter: `generate` names it, everything
    else is the base client's (the server's routing step resolves a model name to one of these)."""

    def __init__(self, base: EngineClient, lora_name: str):
        self.base, self.lora_name = base, lora_name

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    def generate(self, *args, **kwargs) -> AsyncIterator[RequestOutput]:
        return self.base.generate(*args, lora_name=self.lora_name, **kwargs)


class InprocClient(EngineClient):
    kind = "inproc"

    def __init__(self, core, tokenizer, model_name: str):
        info = EngineInfo(model_name, core.max_model_len, core.block_size, core.model_config.vocab_size,
                          core.context_limited_by_kv)
        super().__init__(tokenizer, info, core.config.enable_prefix_caching)
        self.core = core
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        await super().start()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is not None:
            self._inbox.put(Shutdown())
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None

    def stats(self) -> dict:
        return self.core.stats()

    def lora_names(self) -> list[str]:
        return self.core.lora.names()

    def add_lora(self, name: str, path: str) -> None:
        self.core.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        self.core.lora.remove(name)

    def _send(self, msgs: list[CoreInput]) -> None:
        for m in msgs:
            self._inbox.put(m)

    def _run(self) -> None:
        # stats() reads the core directly: no per-step snapshot needed on this path
        self.core.run_busy_loop(self._poll, lambda outs: self._call_soon(self._on_outputs, outs), with_stats=False)

    def _poll(self, timeout: float) -> list[CoreInput]:
        msgs = []
        try:
            msgs.append(self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait())
            while True:
                msgs.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return msgs


class MPClient(EngineClient):
    kind = "process"

    def __init__(self, ready: EngineReady, proc: subprocess.Popen, ctx, push, pull, tmpdir: str):
        from kvserve.engine.process import tokenizer_from_spec

        info = EngineInfo(ready.model_name, ready.max_model_len, ready.block_size, ready.vocab_size,
                          ready.kv_cache_limited)
        super().__init__(tokenizer_from_spec(ready.tokenizer), info, ready.enable_prefix_caching)
        self.proc, self._ctx, self._push, self._pull, self._tmpdir = proc, ctx, push, pull, tmpdir
        self._reader: threading.Thread | None = None
        self._closing = False

    @classmethod
    def launch(cls, model: str | None, weight_format: str, engine_kwargs: dict, timeout: float = 900) -> MPClient:
        """Start the engine process and wait until its model is loaded (blocking)."""
        import msgspec
        import zmq

        tmpdir = tempfile.mkdtemp(prefix="kvserve-engine-")
        ctx = zmq.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.setsockopt(zmq.LINGER, 0)
        in_addr, out_addr = f"ipc://{tmpdir}/in", f"ipc://{tmpdir}/out"
        push.bind(in_addr)
        pull.bind(out_addr)
        spec = msgspec.json.encode({"model": model, "weight_format": weight_format, "engine_kwargs": engine_kwargs,
                                    "input": in_addr, "output": out_addr, "parent_pid": os.getpid()}).decode()
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.engine.process", spec], stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while not pull.poll(250):
                if proc.poll() is not None:
                    raise ModelLoadError(f"the engine process exited with code {proc.returncode} while loading")
                if time.monotonic() > deadline:
                    raise ModelLoadError(f"the engine process did not load the model in {timeout:.0f} s")
            msg = decode_output(pull.recv())
            if isinstance(msg, EngineFailed):
                raise ModelLoadError(msg.message)
            if not isinstance(msg, EngineReady):
                raise ModelLoadError(f"the engine process sent {type(msg).__name__} before it was ready")
        except BaseException:
            proc.kill()
            proc.wait()
            push.close()
            pull.close()
            ctx.term()
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        client = cls(msg, proc, ctx, push, pull, tmpdir)
        from kvserve.engine.lora import parse_lora_modules
        client._lora_names = list(parse_lora_modules(engine_kwargs.get("lora_modules")))
        return client

    async def start(self) -> None:
        await super().start()
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, args=(self._call_soon,),
                                            name="kvserve-engine-reader", daemon=True)
            self._reader.start()

    def _read(self, call_soon: Callable) -> None:
        """Reader thread: decode each message from the engine process and hand it to the loop."""
        while not self._closing:
            if self._pull.poll(200):
                msg = decode_output(self._pull.recv())
                if isinstance(msg, EngineCoreOutputs):
                    call_soon(self._on_outputs, msg)
            elif self.proc.poll() is not None:
                if not self._closing:
                    call_soon(self._fail_all, f"the engine process exited with code {self.proc.returncode}")
                return

    def _send(self, msgs: list[CoreInput]) -> None:
        for m in msgs:
            self._push.send(encode(m))

    async def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self.proc.poll() is None:
            self._push.send(encode(Shutdown()))
            try:
                await asyncio.to_thread(self.proc.wait, 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 5)
        self._push.close()
        self._pull.close()
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def health(self) -> None:
        if self._dead is None and self.proc.poll() is not None and not self._closing:
            self._dead = f"the engine process exited with code {self.proc.returncode}"
        super().health()


def make_engine_client(model: str | None = None, *, engine_process: bool = False, weight_format: str = "auto",
                       **engine_kwargs) -> EngineClient:
    """Load `model` and return a client for it (blocking: call it from a thread). With
    `engine_process`, the engine runs in its own process."""
    from kvserve.engine.config import EngineConfig

    cfg = EngineConfig(weight_format=weight_format, **engine_kwargs)   # bad options fail here, in this process
    if engine_process:
        return MPClient.launch(model, weight_format, engine_kwargs)
    from kvserve.engine.core import EngineCore
    from kvserve.model.loader import load_model

    loaded = load_model(model, weight_format=weight_format)
    core = EngineCore(loaded.model, cfg, loaded.tokenizer.eos_token_ids, loaded.tokenizer)
    return InprocClient(core, loaded.tokenizer, loaded.source.name)


