"""The generation endpoints, /v1/chat/completions and /v1/completions: one handler, read top to bottom.

    (the key's request bucket was taken by the middleware: 429)
    parse + validate (400) → gates: model (404; 503 while loading), ladder
    (503, or a max_tokens cap) → prompt: template + tokenize in a thread (context.py; 400 when it
    does not fit) → SamplingParams (400) → token reservation (429) → admission slot (waits; 503
    when the queue is full) → engine.generate() → each choice's deltas through its stage list
    (stages.py) → one JSON body or SSE events (formatting.py)

The handler's own time per engine output (stages, formatting, and for SSE the write that
`yield` hands each event to) is added to `server.http_ns`, the `http` phase of the profile
(app.ServerState.engine_stats).

Every gate is a call that returns or raises; nothing calls back into the handler. What the request
holds (admission slot, token reservation, engine requests) is given back by `_release`, exactly
once, whether the response completed, failed or the client hung up; it also writes the usage
ledger and puts the request's fields on the access-log record the middleware made.

A /v1/completions request with several prompts runs them as concurrent engine requests under one
admission slot, their outputs merged into one stream (`_engine_outputs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.errors import InvalidRequest, KVServeError
from kvserve.outputs import RequestOutput
from kvserve.server.admission import Ticket, engine_priority
from kvserve.server.context import build_prompts, reasoning_budget, token_texts
from kvserve.server.formatting import ChunkWriter, TokenTexts, chat_body, completion_body, echo_text, trace
from kvserve.server.limits import read_body
from kvserve.server.moderation import cut_if_filtered, prompt_tokenizer
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_caps,
    parse_body,
    to_sampling_params,
)
from kvserve.server.records import Generation, RequestRecord, Timings
from kvserve.server.stages import ChoiceDelta, build_stages, run_stages
from kvserve.server.structured import for_request
from kvserve.server.tools import make_plan

logger = logging.getLogger("kvserve.server")
CAP_HEADER = "x-kvserve-max-tokens-capped"
TRUNCATED_HEADER = "x-kvserve-truncated-messages"
INTERNAL_ERROR = {"error": {"message": "Internal error while generating; the response is incomplete.",
                            "type": "server_error", "param": None, "code": "internal_error"}}


def mount(app: FastAPI, server) -> None:
    """Add the generation routes to `app`, serving from `server` (app.ServerState)."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(server, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(server, request, "completion")


async def generate(server, request: Request, kind: str) -> Response:
    """One generation request ("chat" or "completion"), from raw body to response, in order."""
    record: RequestRecord = request.state.record
    settings, chat = server.settings, kind == "chat"

    # 1. parse and validate
    req = parse_body(await read_body(request, settings.max_body_bytes, settings.body_timeout_s),
                     ChatCompletionRequest if chat else CompletionRequest, settings.max_json_depth)
    check_caps(req, settings)
    moderation = server.moderation.config_for(record)    # input moderation, before any queue (400)
    checks = await server.moderation.check_input_async(req, record, moderation,
                                                       prompt_tokenizer(server, req) if not chat else None)
    timings = Timings(t0=record.t0, parsed=time.monotonic())

    # 2. gates: the model ("auto": the router picks one; features.py), the ladder, the semantic cache
    features = server.features
    requested, route, query = await features.route(req, kind, record.key_tier)
    engine, model_name = server.require_engine(requested)
    key = record.key
    headers: dict[str, str] = {}
    max_tokens = req.requested_max_tokens()
    cap = server.admission.check(record.key_tier).max_tokens_cap
    if cap is not None and (max_tokens is None or max_tokens > cap):
        max_tokens = cap
        headers[CAP_HEADER] = str(cap)
    cached, cache_plan = await features.from_cache(req, kind, model_name, record.key_name, CAP_HEADER in headers,
                                                   route, query)
    if cached is not None:      # a request served, with no tokens computed; usage written after the answer
        cached.background = BackgroundTask(server.keystore.record_usage, record.key_name, 0, 0, 0)
        return cached

    # 3. the prompt(s)
    plan = make_plan(req.tools, req.tool_choice, req.parallel_tool_calls) if chat else None
    tok = engine.tokenizer
    prompts = await asyncio.to_thread(build_prompts, tok, req, max_model_len=engine.max_model_len,
                                      max_tokens=max_tokens, tools=plan)
    if prompts[0].dropped_messages:
        headers[TRUNCATED_HEADER] = str(prompts[0].dropped_messages)
    texts = await asyncio.to_thread(token_texts, tok, prompts[0].token_ids) if req.kvserve_trace else []
    timings.tokenized = time.monotonic()

    # 4. sampling parameters
    if max_tokens is None:
        longest = max(len(p.token_ids) for p in prompts)
        max_tokens = min(settings.default_max_tokens, engine.max_model_len - longest)
    top = ((req.top_logprobs or 0) if req.logprobs else None) if chat else req.logprobs
    echo = not chat and req.echo
    structured = for_request(req, plan)
    if structured is not None:    # compiled off the event loop, with a time limit (cached per grammar)
        await engine.inputs.grammar_compiler().prepare_async(*structured)
    params = to_sampling_params(req, max_tokens, logprobs=max(top or 0, 5) if req.kvserve_trace else top,
                                prompt_logprobs=req.logprobs if echo else None,
                                extra_stop=plan.stop if plan is not None else None,
                                structured=structured[0] if structured else None,
                                reasoning_budget=reasoning_budget(req))
    check_kv_budget(engine, prompts, max_tokens, params.num_sequences)
    if req.stream and params.best_of is not None and params.best_of > params.n:
        raise InvalidRequest("best_of > n cannot be streamed; drop best_of or stream=false.", param="best_of")
    gen = Generation.create(kind, prompts, params,
                            lambda: build_stages(plan, reasoning=chat,
                                                 moderation=lambda: server.moderation.output_stage(moderation)),
                            model_name=model_name, timings=timings, top_logprobs=top, trace=req.kvserve_trace,
                            prompt_token_texts=texts, priority=engine_priority(record.key_tier, req.priority),
                            engine=engine, cost_per_token=server.pool.entry(model_name).cost_per_token,
                            cache_plan=cache_plan, trace_extra={"router": route} if route else {}, moderation=checks)

    # 5. token reservation, then an admission slot
    reserve = sum(len(p.token_ids) + max_tokens * params.num_sequences for p in prompts)
    gen.reserved_tokens = server.limiter.reserve_tokens(record.key_name, key.tpm if key else None, reserve)
    try:
        gen.ticket = await until_disconnected(request.receive, server.admission.acquire(gen.priority))
    except BaseException as e:
        await _release(server, gen, record, e.status if isinstance(e, KVServeError) else 499)
        raise
    timings.gateway_wait_s = gen.ticket.waited_s

    # 6. generate; answer as SSE events or as one JSON body
    decode = TokenTexts(tok)
    deltas = _deltas(server, gen, server.cache_scope.salt(key, req.cache_salt), req.cache_salt)
    echoes = [echo_text(tok, ps) for ps in gen.prompts] if echo else None
    if req.stream:
        writer = ChunkWriter(gen, bool(req.stream_options and req.stream_options.include_usage), decode)
        return StreamingResponse(_events(server, gen, record, deltas, writer, echoes),
                                 media_type="text/event-stream", headers=headers,
                                 background=BackgroundTask(_release, server, gen, record, 499))
    try:
        await until_disconnected(request.receive, _drain(deltas))
    except ClientGone:
        await _release(server, gen, record, 499, "client disconnected")
        return Response(status_code=499)
    except KVServeError as e:
        await _release(server, gen, record, e.status, e.message)
        raise
    except BaseException as e:
        await _release(server, gen, record, 500, repr(e))
        raise
    t0 = time.perf_counter_ns()
    body = (chat_body(gen, decode, engine.block_size) if chat else
            completion_body(gen, echoes, decode, engine.block_size))
    response = JSONResponse(body, headers=headers)
    server.http_ns += time.perf_counter_ns() - t0
    await _release(server, gen, record, 200)
    return response


def check_kv_budget(engine, prompts: list, max_tokens: int, num_sequences: int) -> None:
    """400 when a request's sequences together could never be resident in the KV cache at once
    (each prompt once, shared by its sequences, plus max_tokens for every sequence)."""
    blocks = engine.stats().get("kv_blocks_total")
    if not blocks:
        return
    capacity = blocks * engine.block_size
    need = sum(len(p.token_ids) + num_sequences * max_tokens for p in prompts)
    if need > capacity:
        raise InvalidRequest(f"This request needs room for {need} tokens (prompts + n x max_tokens) but the "
                             f"KV cache holds {capacity}; lower n, best_of or max_tokens.", param="max_tokens")


# ---- engine outputs -> stage lists ------------------------------------------------------------

async def _engine_outputs(server, gen: Generation, salt: str | None, client_salt: str | None
                          ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from the engine, every prompt of the request merged into one stream.
    `salt` scopes the prefix cache (cache_scope.py); declared shared prompts stay unsalted."""
    engine, scope = gen.engine, server.cache_scope
    gen.streams = [engine.generate(ps.prompt.token_ids, gen.params, ps.request_id, priority=gen.priority,
                                   cache_salt=salt, prompt=ps.prompt.text,
                                   cache_salt_from=scope.shared_prefix(engine.tokenizer, ps.prompt.token_ids,
                                                                       client_salt))
                   for ps in gen.prompts]
    gen.started = True
    if len(gen.streams) == 1:
        async for out in gen.streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which maps it to an error body
            await queue.put((i, e))
            return
        await queue.put((i, None))

    gen.tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(gen.streams)]
    pending = len(gen.tasks)
    while pending:
        i, item = await queue.get()
        if item is None:
            pending -= 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield i, item


async def _deltas(server, gen: Generation, salt: str | None, client_salt: str | None
                  ) -> AsyncIterator[tuple[int, int, ChoiceDelta]]:
    """(prompt index, choice index, delta after the choice's stages) for every step, each choice's
    state accumulated. A forced tool call's opening (the prompt's last text, which the answer
    continues) goes through the stages first."""
    for pi, ps in enumerate(gen.prompts):
        if ps.prompt.forced_prefix:
            for ci, ch in enumerate(ps.choices):
                yield pi, ci, ch.add(run_stages(ch.stages, ChoiceDelta(ci, ps.prompt.forced_prefix)))
    async for pi, out in _engine_outputs(server, gen, salt, client_salt):
        t0 = time.perf_counter_ns()
        ps = gen.prompts[pi]
        if out.prompt_logprobs is not None:
            ps.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            ps.final = out   # one metrics observation per engine request that finished
            server.metrics.observe_request(out.metrics, out.outputs[0].finish_reason if out.outputs else None,
                                           gateway_wait_s=gen.timings.gateway_wait_s, model=gen.model_name)
        for c in out.outputs:
            if c.index >= len(ps.choices) or not (c.text_delta or c.token_ids_delta or c.finish_reason):
                continue
            ch = ps.choices[c.index]
            if ch.finish_reason is not None:    # ended by a stage (output moderation): nothing more
                continue
            d = ch.add(run_stages(ch.stages, ChoiceDelta.from_output(c)))
            await cut_if_filtered(gen, ps, d)
            server.http_ns += time.perf_counter_ns() - t0
            yield pi, c.index, d
            t0 = time.perf_counter_ns()
        server.http_ns += time.perf_counter_ns() - t0
        if all(ch.finish_reason is not None for p in gen.prompts for ch in p.choices):
            return


async def _drain(deltas: AsyncIterator) -> None:
    async for _ in deltas:
        pass


async def _events(server, gen: Generation, record: RequestRecord, deltas: AsyncIterator,
                  writer: ChunkWriter, echoes: list[str] | None) -> AsyncIterator[str]:
    """The SSE body; an error after the stream started is sent as `data: {"error": ...}` before [DONE]."""
    n = gen.params.n
    status, error = 200, None
    try:
        if gen.kind == "chat":
            yield writer.roles(n)
        for pi, text in enumerate(echoes or []):
            yield writer.echo(pi * n, n, text)
        async for pi, ci, d in deltas:
            t0 = time.perf_counter_ns()
            tr = (trace(gen, gen.prompts[0], writer.decode, gen.engine.block_size)
                  if d.done and gen.trace and pi == ci == 0 else None)
            if (event := writer.choice(pi * n + ci, d, tr)) is not None:
                yield event      # returns once the response has written it
            server.http_ns += time.perf_counter_ns() - t0
        if writer.include_usage:
            yield writer.usage()
    except KVServeError as e:
        status, error = e.status, e.message
        yield writer.error(e.to_dict())
    except Exception as e:
        logger.exception("error while streaming %s", gen.id)
        status, error = 500, repr(e)
        yield writer.error(INTERNAL_ERROR)
    except BaseException:
        status, error = 499, "client disconnected"
        raise
    finally:
        await _release(server, gen, record, status, error)
    yield writer.done()


# ---- the end of a request -------------------------------------------------------------------

async def _release(server, gen: Generation, record: RequestRecord, status: int, error: str | None = None) -> None:
    """Stop engine work, release the slot, refund unused tokens, write the ledger and the
    access-log fields. Runs once; later calls return at once."""
    if gen.released:
        return
    gen.released = True
    with anyio.CancelScope(shield=True):
        for t in gen.tasks:
            t.cancel()
        if gen.tasks:
            await asyncio.gather(*gen.tasks, return_exceptions=True)
        for stream in gen.streams:   # closing a suspended stream aborts its engine request
            with contextlib.suppress(RuntimeError):
                await stream.aclose()
        if gen.started:
            for ps in gen.prompts:
                if ps.final is None:
                    with contextlib.suppress(Exception):  # already gone is fine
                        await gen.engine.abort(ps.request_id)
        if gen.ticket is not None:
            gen.ticket.release()
        prompt, completion, cached = gen.usage_counts()
        key = record.key
        if gen.reserved_tokens:
            server.limiter.refund_tokens(record.key_name, key.tpm if key else None,
                                         gen.reserved_tokens - prompt - completion)
        if gen.started:
            try:
                await asyncio.to_thread(server.keystore.record_usage, record.key_name, prompt, completion, cached)
            except Exception:
                logger.exception("usage ledger write failed")
            try:
                await asyncio.to_thread(server.features.store, gen, gen.cache_plan, status)
            except Exception:
                logger.exception("semantic cache write failed")
    record.generation = gen.log(status, error)


# ---- the request's connection ------------------------------------------------------------

class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


async def until_disconnected(receive, aw):
    """Await `aw`, cancelling it (and raising ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(aw)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        result = await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - we only need it stopped
        result = None
    if isinstance(result, Ticket):
        result.release()
    raise ClientGone()
