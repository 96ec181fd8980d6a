"""Ollama's API: `/api/chat`, `/api/generate`, `/api/embed`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`.

Generation becomes a chat (or, for `raw` and `suffix` generate, a completions) request on the one
generation path, with the same gates, stage list and usage ledger as OpenAI's routes;
`OllamaRenderer` (ollama_wire.py) writes NDJSON lines (`"stream"` defaults to true, as in Ollama)
or one object.

    messages (system/user/assistant/tool; assistant tool_calls, tool turns by tool_name) -> chat
    generate: system + prompt -> a chat of two turns (the model's template); raw -> the prompt as is;
             suffix -> fill in the middle with the model's FIM tokens (api/ollama_fim.py; a 400 for a
             model without them)
    images -> a 400 naming the model: every model served here is text-only
    logprobs, top_logprobs -> each token's logprob and its alternatives, as Ollama returns them
    options: temperature, top_k, top_p, min_p, seed, num_predict (max_tokens; -1/-2: until the
             window), stop, repeat_penalty, presence/frequency_penalty -> the sampling fields;
             num_ctx caps prompt + answer (the answer's max_tokens is cut to fit; a prompt longer
             than num_ctx is a 400); the hardware and mirostat options are accepted and ignored,
             an unknown option is a 400
    format "json" -> response_format json_object; a JSON schema -> json_schema
    tools (OpenAI's function shape) -> tools; think true/"low"/"medium"/"high" -> reasoning_effort
    keep_alive -> how long a model on demand (--models-dir) stays loaded after the request
             (routing/residency.py); an empty chat or generate loads it (done_reason "load"), or
             with keep_alive 0 unloads it ("unload"); a pinned model stays loaded

`/api/tags`, `/api/show` and `/api/ps` describe the models from their files (api/ollama_models.py);
`/api/embed` is `/v1/embeddings` (api/embeddings.py) in Ollama's shape. Errors are
`{"error": "..."}` (error_shapes.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

import kvserve
from kvserve.errors import ContextLengthExceeded, InvalidRequest
from kvserve.server.api.embeddings import EmbeddingRequest, embed_texts, json_body
from kvserve.server.api.ollama_fim import fim_prompt
from kvserve.server.api.ollama_models import mount_ollama_models, served_name
from kvserve.server.api.ollama_wire import OllamaRenderer, line, now
from kvserve.server.api.shared import count_prompt_tokens, deliver, start, under_lease
from kvserve.server.gates.auth import manages_models
from kvserve.server.generation import ClientGone, ModelHandle, run_generation
from kvserve.server.generation.plan import charge_load, check_before_load
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _Strict,
    read_request,
    validate_body,
)
from kvserve.server.routing.residency import Hold

if TYPE_CHECKING:
    from kvserve.server.records import RequestRecord
    from kvserve.server.state import ServerState

OLLAMA_VERSION = "0.12.0"     # the Ollama API version whose routes and fields this module speaks
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "min_p": "min_p", "seed": "seed", "stop": "stop",
            "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}
Think = bool | Literal["low", "medium", "high"] | None


class Options(_Strict):
    """Ollama's `options`: the sampling ones are mapped (SAMPLING, top_k, num_predict, num_ctx); the
    hardware and mirostat ones are accepted and ignored; any other key is a 400."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = Field(default=None, ge=2)
    # ignored
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    tfs_z: float | None = None
    typical_p: float | None = None
    repeat_last_n: int | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None


class OllamaMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    thinking: str | None = None          # an earlier answer's reasoning: not sent back to the model
    images: list[Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None


class _Generation(_Strict):
    model: str
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: float | str | None = None
    think: Think = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatBody(_Generation):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_Generation):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[Any] | None = None


class EmbedBody(_Strict):
    model: str
    input: str | list[str]
    truncate: bool | None = None
    options: Options | None = None      # accepted; the encoder has no sampling
    keep_alive: float | str | None = None
    dimensions: int | None = None


def _options(options: Options | None, out: dict[str, Any]) -> int | None:
    """Sampling fields from `options` into the request body `out`; returns num_ctx (None: unset)."""
    if options is None:
        return None
    for key, dst in SAMPLING.items():
        if getattr(options, key) is not None:
            out[dst] = getattr(options, key)
    if options.top_k is not None and options.top_k > 0:              # Ollama: 0 turns top-k off
        out["top_k"] = options.top_k
    if options.num_predict is not None and options.num_predict > 0:  # -1: until the window is full; -2: fill it
        out["max_tokens"] = options.num_predict
    return options.num_ctx


def _common(body: _Generation, out: dict[str, Any]) -> int | None:
    """The fields chat and generate share, into `out`; returns num_ctx."""
    out.update(model=served_name(body.model), stream=body.stream)
    if body.logprobs:     # chat: logprobs + top_logprobs; completions (raw, suffix): logprobs = the top count
        out |= {"logprobs": True, "top_logprobs": body.top_logprobs or 0} if "messages" in out else {
            "logprobs": body.top_logprobs or 0}
    if body.format == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": body.format}}
    elif body.format not in (None, ""):
        raise InvalidRequest('format must be "json" or a JSON schema.', param="format")
    if body.think is True:
        out["reasoning_effort"] = "medium"
    elif isinstance(body.think, str):
        out["reasoning_effort"] = body.think
    return _options(body.options, out)


def no_images(model: str, param: str) -> InvalidRequest:
    return InvalidRequest(f"{model} does not support images: it is a text-only model (this server runs no "
                          "vision model). Send the message without images.", param=param)


def chat_messages(messages: list[OllamaMessage], model: str) -> list[dict[str, Any]]:
    """Ollama's turns as chat completions messages: the assistant's calls get ids, and each tool
    turn answers the first unanswered call of its `tool_name` (else the first unanswered one)."""
    out: list[dict[str, Any]] = []
    open_calls: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.images:
            raise no_images(model, f"messages[{i}].images")
        turn: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                fn = c.get("function")
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise InvalidRequest("A tool call needs function.name.", param=f"messages[{i}].tool_calls[{j}]")
                args = fn.get("arguments") or {}
                calls.append({"id": f"call_{i}_{j}", "type": "function", "function": {
                    "name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
            turn["tool_calls"] = calls
            open_calls = list(calls)
        elif m.role == "tool":
            if not open_calls:
                raise InvalidRequest("A tool message must follow an assistant message with tool_calls.",
                                     param=f"messages[{i}]")
            match = next((c for c in open_calls if c["function"]["name"] == m.tool_name), open_calls[0])
            open_calls.remove(match)
            turn["tool_call_id"] = match["id"]
        out.append(turn)
    return out


def chat_request(body: ChatBody) -> tuple[dict[str, Any], int | None]:
    chat: dict[str, Any] = {"messages": chat_messages(body.messages, body.model)}
    num_ctx = _common(body, chat)
    if body.tools:
        chat["tools"] = []
        for i, t in enumerate(body.tools):
            fn = t.get("function")
            if t.get("type", "function") != "function" or not isinstance(fn, dict):
                raise InvalidRequest('A tool is {"type": "function", "function": {"name", "description", '
                                     '"parameters"}}.', param=f"tools[{i}]")
            chat["tools"].append({"type": "function", "function": {
                k: v for k, v in fn.items() if k in ("name", "description", "parameters")}})
    return chat, num_ctx


def generate_request(body: GenerateBody, fim: list[int] | None = None) -> tuple[dict[str, Any], int | None, bool]:
    """(the body, num_ctx, whether it is a chat request) of a generate with a prompt (or a suffix:
    `fim` is then the fill-in-the-middle prompt's token ids, api/ollama_fim.py)."""
    if body.template:
        raise InvalidRequest("template is not supported; the model's own chat template is used.", param="template")
    if body.context:
        raise InvalidRequest("context is not supported; continue a conversation with /api/chat.", param="context")
    if body.images:
        raise no_images(body.model, "images")
    if body.suffix:
        if body.raw:
            raise InvalidRequest("raw and suffix cannot be combined: a raw prompt is sent as it is, while suffix "
                                 "frames it with the model's fill-in-the-middle tokens.", param="suffix")
        if fim is None:
            raise InvalidRequest("suffix needs the model's fill-in-the-middle tokens.", param="suffix")
        out: dict[str, Any] = {"prompt": [fim]}      # one prompt of token ids
    elif body.raw:
        out = {"prompt": (body.system + "\n" if body.system else "") + (body.prompt or "")}
    else:
        msgs = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}]
        out = {"messages": msgs}
        return out, _common(body, out), True
    num_ctx = _common(body, out)
    out.pop("reasoning_effort", None)
    out.setdefault("max_tokens", None)
    return out, num_ctx, False


async def _cap_to_window(gw: ServerState, req: ChatCompletionRequest | CompletionRequest, num_ctx: int | None,
                         caller: str | None) -> None:
    """num_ctx as a cap: max_tokens cut so that prompt + answer fits in num_ctx tokens."""
    if num_ctx is None:
        return
    model = ModelHandle.resolve(gw, req.model, caller)
    if num_ctx >= model.max_model_len:
        return
    if isinstance(req, ChatCompletionRequest):
        n = await count_prompt_tokens(gw, req, caller)
    elif isinstance(req.prompt, list):       # a fill-in-the-middle prompt: [token ids]
        n = len(req.prompt[0])
    else:
        n = len(await asyncio.to_thread(model.tokenizer.encode, req.prompt, add_special_tokens=True))
    if n >= num_ctx:
        raise ContextLengthExceeded(f"The prompt takes {n} tokens, more than options.num_ctx={num_ctx}.",
                                    param="options.num_ctx")
    req.max_tokens = min(req.max_tokens or num_ctx, num_ctx - n)


def mount_ollama(app: FastAPI, gw: ServerState) -> None:
    settings = gw.settings

    async def generation(request: Request, body: dict[str, Any], num_ctx: int | None, chat: bool,
                         model: str, hold: Hold | None) -> Response:
        """`hold`: the model on demand, held (loaded) only when num_ctx or a suffix needs its tokenizer,
        after the gates that need no model; given back once the plan holds it."""
        try:
            req = validate_body(body, ChatCompletionRequest if chat else CompletionRequest)
            check_before_load(gw, request.state.record, req)
            if num_ctx is not None:
                if hold is None:
                    charge_load(gw, request.state.record, served_name(model))
                    hold = await gw.pool.acquire(served_name(model))
                await _cap_to_window(gw, req, num_ctx, request.state.record.key_name)
            gen, lease = await start(gw, request, req, "chat" if chat else "completion")
        finally:
            if hold is not None:
                hold.release()                                # the request's lease holds it from here
        render = OllamaRenderer(gen, chat=request.url.path == "/api/chat", model=model)

        async def whole() -> Response:
            return JSONResponse(render.whole(), headers=gen.plan.headers)

        def lines():
            return under_lease(gen, lease, render.lines(run_generation(gw, gen, lease)), render.failed)

        return await deliver(gw, request, gen, lease, lines, whole, media_type="application/x-ndjson")

    async def load(body: ChatBody | GenerateBody, chat: bool, record: RequestRecord) -> Response:
        """Ollama's way to load (keep_alive 0: unload) a model: a request with nothing to answer."""
        if body.keep_alive not in (0, "0", "0s"):
            charge_load(gw, record, served_name(body.model))
        await gw.pool.preload(served_name(body.model), body.keep_alive, manages_models(record))
        out: dict[str, Any] = {"model": body.model, "created_at": now()}
        out |= {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
        out |= {"done": True, "done_reason": "unload" if body.keep_alive in (0, "0", "0s") else "load"}
        return Response(line(out), media_type="application/x-ndjson") if body.stream else JSONResponse(out)

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        body = await read_request(request, ChatBody, settings)
        record = request.state.record
        if not body.messages:
            return await load(body, chat=True, record=record)
        gw.pool.set_keep_alive(body.keep_alive, manages_models(record))
        chat_body, num_ctx = chat_request(body)
        return await generation(request, chat_body, num_ctx, True, body.model, None)

    @app.post("/api/generate")
    async def generate(request: Request) -> Response:
        body = await read_request(request, GenerateBody, settings)
        record = request.state.record
        if not body.prompt and not body.system and not body.suffix:
            return await load(body, chat=False, record=record)
        gw.pool.set_keep_alive(body.keep_alive, manages_models(record))
        hold = None
        fim = None
        if body.suffix and not body.raw:     # tokenized off the event loop, as every prompt
            plain, _, plain_chat = generate_request(body.model_copy(update={"suffix": None}), None)   # gates first
            check_before_load(gw, record, validate_body(plain, ChatCompletionRequest if plain_chat
                                                        else CompletionRequest))
            charge_load(gw, record, served_name(body.model))
            hold = await gw.pool.acquire(served_name(body.model))   # on demand: loaded before the suffix is read
            try:
                tokenizer = ModelHandle.resolve(gw, served_name(body.model), record.key_name).tokenizer
                fim = await asyncio.to_thread(fim_prompt, tokenizer, body.model, body.prompt or "", body.suffix)
            except BaseException:
                hold.release()
                raise
        gen_body, num_ctx, is_chat = generate_request(body, fim)
        return await generation(request, gen_body, num_ctx, is_chat, body.model, hold)

    @app.post("/api/embed")
    async def embed(request: Request) -> Response:
        body = await read_request(request, EmbedBody, settings)
        req = validate_body({"input": body.input, "model": served_name(body.model), "dimensions": body.dimensions},
                            EmbeddingRequest)
        embedder = gw.routing.embedder
        try:
            vecs, tokens = await embed_texts(gw, embedder, request, req)
        except ClientGone:
            return Response(status_code=499)
        out = {"model": body.model, "embeddings": vecs, "prompt_eval_count": tokens}
        return Response(await embedder.run(json_body, out), media_type="application/json")   # as /v1/embeddings

    @app.get("/api/version")
    async def version() -> dict:
        return {"version": OLLAMA_VERSION, "kvserve": kvserve.__version__}

    mount_ollama_models(app, gw)
