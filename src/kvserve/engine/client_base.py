"""The EngineClient interface and the machinery its transports share (engine/client.py has the
in-process and engine-process transports, engine/ray_client.py the Ray replicas); see client.py's
docstring for the interface."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable

from kvserve.engine.messages import AbortRequests, CoreInput, EngineCoreOutputs
from kvserve.engine.processing import EngineInfo, EngineInfoView, InputProcessor, OutputProcessor
from kvserve.errors import InvalidRequest, KVServeError, ModelNotFound
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.structured.grammar import available


class EngineDeadError(KVServeError):
    """The engine stopped (its process died): 503 with Retry-After, as the server restarts it."""

    status = 503
    type = "server_error"
    code = "engine_error"
    retry_after = 5.0


class EngineClient(EngineInfoView):
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
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
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
                       prompt: str | None = None, lora_name: str | None = None,
                       draft_token_ids: list[int] | None = None,
                       draft_min_logprob: float | None = None) -> AsyncIterator[RequestOutput]:
        """`draft_token_ids`: a continuation to verify as draft tokens (EngineCoreRequest.draft_token_ids;
        one sequence only, ids inside the vocabulary); `draft_min_logprob`: a sampled request keeps
        them by likelihood (EngineCoreRequest.draft_min_logprob)."""
        self.health()
        if request_id in self.outputs.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        if lora_name is not None and lora_name not in self.lora_names():
            raise ModelNotFound(f"The model {lora_name!r} does not exist on this server (GET /v1/models).",
                                param="model")
        reqs = self.inputs.requests(request_id, list(prompt_token_ids), params, priority=priority,
                                    cache_salt=cache_salt, cache_salt_from=cache_salt_from, lora_name=lora_name)
        vocab = self.inputs.info.vocab_size
        if draft_token_ids and len(reqs) == 1 and all(0 <= t < vocab for t in draft_token_ids):
            reqs[0].draft_token_ids = list(draft_token_ids[:params.max_tokens or None])
            reqs[0].draft_min_logprob = draft_min_logprob
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
