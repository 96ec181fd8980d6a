"""The two generation endpoints: /v1/chat/completions and /v1/completions.

Both go through `_prepare` (the gates listed in serving.py) and then answer either as one JSON
body or as SSE chunks in OpenAI's shapes: `data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`; an
error after the stream started is sent as `data: {"error": {...}}` before [DONE].
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.errors import InvalidRequest, KVServeError
from kvserve.server.context import build_chat_prompt, build_completion_prompts, check_fits, token_texts
from kvserve.server.formatting import chat_logprobs, completion_logprobs, finish_reason, usage
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_caps,
    parse_body,
    to_sampling_params,
)
from kvserve.server.serving import ClientGone, Job, engine_priority, sse, until_disconnected
from kvserve.server.tools import make_plan, parse_output, stream_delta

logger = logging.getLogger("kvserve.server")
CAP_HEADER = "x-kvserve-max-tokens-capped"


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise InvalidRequest(f"The request body is larger than {limit} bytes.", param="body")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise InvalidRequest(f"The request body is larger than {limit} bytes.", param="body")
        chunks.append(chunk)
    return b"".join(chunks)


async def _prepare(server, request: Request, kind: str) -> tuple[Job, object, dict]:
    """Run every gate; returns the job (holding its admission slot), the parsed body and headers."""
    settings = server.settings
    raw = await read_body(request, settings.max_body_bytes)
    req = parse_body(raw, ChatCompletionRequest if kind == "chat" else CompletionRequest)
    check_caps(req, settings)
    marks = {"t0": request.state.t0, "parsed": time.monotonic()}
    engine, model_name = server.require_engine(req.model)
    key = request.state.key
    server.limiter.acquire_request(request.state.key_name, key.rpm if key else None)
    tier = request.state.key_tier
    decision = server.admission.check(tier)
    headers: dict[str, str] = {}
    requested = req.requested_max_tokens()
    if decision.max_tokens_cap is not None and (requested is None or requested > decision.max_tokens_cap):
        requested = decision.max_tokens_cap
        headers[CAP_HEADER] = str(requested)
    tok, max_len = engine.tokenizer, engine.max_model_len
    plan = make_plan(req.tools, req.tool_choice, req.parallel_tool_calls) if kind == "chat" else None
    if kind == "chat":
        prompt = await asyncio.to_thread(build_chat_prompt, tok, req.messages, max_model_len=max_len,
                                         max_tokens=requested, truncate=req.truncate,
                                         add_generation_prompt=req.add_generation_prompt, tools=plan)
        if prompt.dropped_messages:
            headers["x-kvserve-truncated-messages"] = str(prompt.dropped_messages)
        prompts = [prompt]
    else:
        prompts = await asyncio.to_thread(build_completion_prompts, tok, req.prompt,
                                          vocab_size=getattr(tok, "vocab_size", None))
        for p in prompts:
            check_fits(p, requested, max_len)
    if req.kvserve_trace:
        marks["prompt_token_texts"] = await asyncio.to_thread(token_texts, tok, prompts[0].token_ids)
    marks["tokenized"] = time.monotonic()
    longest = max(len(p.token_ids) for p in prompts)
    max_tokens = requested if requested is not None else min(settings.default_max_tokens, max_len - longest)
    if kind == "chat":
        client_top = (req.top_logprobs or 0) if req.logprobs else None
        prompt_lp = None
    else:
        client_top = req.logprobs
        prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
    engine_top = max(client_top or 0, 5) if req.kvserve_trace else client_top
    params = to_sampling_params(req, max_tokens, logprobs=engine_top, prompt_logprobs=prompt_lp,
                                extra_stop=plan.stop if plan is not None else None)
    if req.stream and params.best_of is not None and params.best_of > params.n:
        raise InvalidRequest("best_of > n cannot be streamed; drop best_of or stream=false.", param="best_of")
    marks["client_top"] = client_top
    job = Job(server, request, kind=kind, prompts=prompts, params=params,
              priority=engine_priority(tier, req.priority), cache_salt=req.cache_salt, marks=marks,
              trace=req.kvserve_trace, model_name=model_name, tools=plan)
    reserve = sum(len(p.token_ids) + max_tokens * params.num_sequences for p in prompts)
    job.reserved_tokens = server.limiter.reserve_tokens(request.state.key_name, key.tpm if key else None,
                                                        reserve)
    try:
        job.ticket = await until_disconnected(request.receive, server.admission.acquire(job.priority))
    except BaseException:
        await job.finish(499)
        raise
    marks["gateway_wait_s"] = job.ticket.waited_s
    return job, req, headers


async def generate(server, request: Request, kind: str) -> Response:
    job, req, headers = await _prepare(server, request, kind)
    if req.stream:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        body = _stream(job, req, include_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers=headers,
                                 background=BackgroundTask(job.finish, 499))
    try:
        async def collect() -> None:
            async for _ in job.outputs():
                pass
        await until_disconnected(request.receive, collect())
    except ClientGone:
        await job.finish(499, "client disconnected")
        return Response(status_code=499)
    except KVServeError as e:
        await job.finish(e.status, e.message)
        raise
    except BaseException as e:
        await job.finish(500, repr(e))
        raise
    body = _chat_body(job, req) if kind == "chat" else _completion_body(job, req)
    await job.finish(200)
    return JSONResponse(body, headers=headers)


# ---- non-streaming bodies -------------------------------------------------------------------

def _chat_body(job: Job, req: ChatCompletionRequest) -> dict:
    ps = job.prompts[0]
    choices = []
    for i, ch in enumerate(ps.choices):
        lp = (chat_logprobs(ch.token_ids, ch.logprobs, job.marks["client_top"] or 0, job.decode)
              if req.logprobs else None)
        content: str | None = ch.text
        fr = finish_reason(ch.finish_reason)
        if job.tools is not None:
            content, ch.tool_calls = parse_output(job.tools, ps.prompt.forced_prefix, ch.text)
            if ch.tool_calls:
                fr = "tool_calls"
        choices.append({"index": i, "message": {"role": "assistant", "content": content, "refusal": None,
                                                "tool_calls": [c.to_dict() for c in ch.tool_calls]},
                        "logprobs": lp, "finish_reason": fr, "stop_reason": ch.stop_reason})
    body = {"id": job.id, "object": "chat.completion", "created": job.created, "model": job.model_name,
            "choices": choices, "usage": usage(*job.usage_counts()), "system_fingerprint": None}
    if job.trace:
        body["kvserve_trace"] = job.trace_for(ps)
    return body


def _completion_choice_logprobs(job: Job, req: CompletionRequest, ps, ch) -> dict | None:
    top = job.marks["client_top"]
    if top is None:
        return None
    ids, positions = list(ch.token_ids), list(ch.logprobs)
    if req.echo:
        prompt_pos = ps.prompt_logprobs or [None] * len(ps.prompt.token_ids)
        ids = list(ps.prompt.token_ids) + ids
        positions = list(prompt_pos) + positions
    return completion_logprobs(ids, positions, top, job.decode)


def _completion_body(job: Job, req: CompletionRequest) -> dict:
    choices = []
    n = job.params.n
    for pi, ps in enumerate(job.prompts):
        prefix = _echo_text(job, ps) if req.echo else ""
        for ci, ch in enumerate(ps.choices):
            choices.append({"index": pi * n + ci, "text": prefix + ch.text,
                            "logprobs": _completion_choice_logprobs(job, req, ps, ch),
                            "finish_reason": finish_reason(ch.finish_reason), "stop_reason": ch.stop_reason})
    body = {"id": job.id, "object": "text_completion", "created": job.created, "model": job.model_name,
            "choices": choices, "usage": usage(*job.usage_counts()), "system_fingerprint": None}
    if job.trace:
        body["kvserve_trace"] = job.trace_for(job.prompts[0])
    return body


def _echo_text(job: Job, ps) -> str:
    if ps.prompt.text is not None:
        return ps.prompt.text
    return job.server.engine.tokenizer.decode(ps.prompt.token_ids, skip_special_tokens=False)


# ---- streaming ------------------------------------------------------------------------------

async def _stream(job: Job, req, include_usage: bool):
    chat = job.kind == "chat"
    n = job.params.n
    obj = "chat.completion.chunk" if chat else "text_completion"
    status, error = 200, None

    def chunk(choices: list[dict]) -> dict:
        c = {"id": job.id, "object": obj, "created": job.created, "model": job.model_name, "choices": choices}
        if include_usage:
            c["usage"] = None
        return c

    # Tool calls: one parser per choice; the answer continues the prompt's forcing prefix.
    parsers = [job.tools.parser() for _ in range(n)] if chat and job.tools is not None else None
    try:
        if chat:
            yield sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(n)]))
            prefix = job.prompts[0].prompt.forced_prefix
            if parsers is not None and prefix:
                for i, p in enumerate(parsers):
                    if delta := stream_delta(p.feed(prefix)):
                        yield sse(chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]))
        elif req.echo:
            for pi, ps in enumerate(job.prompts):
                text = _echo_text(job, ps)
                yield sse(chunk([{"index": pi * n + i, "text": text, "logprobs": None, "finish_reason": None}
                                 for i in range(n)]))
        top = job.marks["client_top"]
        async for pi, out in job.outputs():
            ps = job.prompts[pi]
            for c in out.outputs:
                if c.index >= n:
                    continue
                done = c.finish_reason is not None
                if not c.text_delta and not c.token_ids_delta and not done:
                    continue
                idx = pi * n + c.index
                lp = None
                if top is not None and c.logprobs_delta:
                    lp = (chat_logprobs(c.token_ids_delta, c.logprobs_delta, top, job.decode) if chat else
                          completion_logprobs(c.token_ids_delta, c.logprobs_delta, top, job.decode))
                fr = finish_reason(c.finish_reason)
                if parsers is not None:
                    p = parsers[c.index]
                    delta = stream_delta(p.feed(c.text_delta) + (p.finish() if done else []))
                    if not delta and lp is None and not done:
                        continue   # text held back: it may be the start of a tool call
                    if done and p.calls:
                        fr = "tool_calls"
                        ps.choices[c.index].tool_calls = p.calls
                    choice = {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": fr}
                elif chat:
                    delta = {"content": c.text_delta} if c.text_delta or not done else {}
                    choice = {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": fr}
                else:
                    choice = {"index": idx, "text": c.text_delta, "logprobs": lp, "finish_reason": fr}
                if done:
                    choice["stop_reason"] = c.stop_reason
                body = chunk([choice])
                if done and job.trace and idx == 0:
                    body["kvserve_trace"] = job.trace_for(ps)
                yield sse(body)
        if include_usage:
            final = chunk([])
            final["usage"] = usage(*job.usage_counts())
            yield sse(final)
    except KVServeError as e:
        status, error = e.status, e.message
        yield sse(e.to_dict())
    except Exception as e:
        logger.exception("error while streaming %s", job.id)
        status, error = 500, repr(e)
        yield sse({"error": {"message": "Internal error while generating; the response is incomplete.",
                             "type": "server_error", "param": None, "code": "internal_error"}})
    except BaseException:
        status, error = 499, "client disconnected"
        raise
    finally:
        await job.finish(status, error)
    yield sse("[DONE]")
