"""The generation plan: what one request will run, built once from any API's body, gates included.

    parse (the API's module) → `build_plan`: caps (400) → the key's tpm bound (429: the
    answer's max_tokens alone does not fit the bucket) → input moderation (400; a long chat with
    `truncate: "oldest"` is fitted to the window first and judged on the turns kept) → only then a
    model on demand loaded (waits) and held until the lease ends (routing/residency.py), so a
    refused request never loads a model → route: the model ("auto": the router), the pool
    (404; 503 while loading) → the ladder's max_tokens cap
    → the semantic cache (a candidate answer becomes the engine request's draft, verified by the
    model; with `verify` off a hit is a plan with a cached answer and nothing to run) → the prompt:
    template + tokenize in a thread (context.py; 400 when it does not fit) → grammar compiled off
    the event loop → SamplingParams (400) → the KV budget (400)

Every gate is a call that returns or raises. The plan says what to run; what the request holds
while it runs (admission slot, token reservation, engine streams) is the `Lease` (lease.py), and
what came back is the `Generation` (state.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvserve.errors import InvalidRequest, KVServeError
from kvserve.safety.moderator import ModerationConfig
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.server.gates.admission import engine_priority
from kvserve.server.gates.moderation import annotation_header, has_token_prompts, input_texts
from kvserve.server.generation.context import (
    Prompt,
    build_prompts,
    reasoning_budget,
    refuse_by_length,
    token_texts,
)
from kvserve.server.generation.engine import ModelHandle
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, check_caps, to_sampling_params
from kvserve.server.routing.embedder import QueryEmbedding
from kvserve.server.routing.semantic_cache import CachePlan, Hit
from kvserve.server.stages import Stage, build_stages
from kvserve.server.stages.structured import for_request
from kvserve.server.stages.tools import ToolPlan, make_plan
from kvserve.server.stores.keys import CLI_KEY_NAME

if TYPE_CHECKING:
    from kvserve.server.records import RequestRecord
    from kvserve.server.state import ServerState
    from kvserve.tokenizer.tokenizer import Tokenizer

Kind = Literal["chat", "completion"]
CAP_HEADER = "x-kvserve-max-tokens-capped"
TRUNCATED_HEADER = "x-kvserve-truncated-messages"
CACHE_HEADER = "x-kvserve-cache"


@dataclass
class Timings:
    """The gateway's own marks (time.monotonic() seconds) for the trace and the access log."""

    t0: float                   # request arrived
    parsed: float = 0.0         # body validated
    tokenized: float = 0.0      # template + tokenize done
    gateway_wait_s: float = 0.0  # time spent in the admission queue


@dataclass(frozen=True)
class CacheScopeKey:
    """The prefix-cache scope of the request's engine requests (routing/cache_scope.py)."""

    salt: str | None = None          # the key's salt (None: shared)
    client_salt: str | None = None   # the request's own `cache_salt`


@dataclass
class GenerationPlan:
    """What one generation request runs: set once by `build_plan`, read by the run and the renderers."""

    kind: Kind
    model: ModelHandle
    prompts: list[Prompt]
    params: SamplingParams | None        # None: a cached answer, nothing to run
    stages: Callable[[], list[Stage]]    # makes one choice's stage list
    timings: Timings
    stream: bool = False
    include_usage: bool = False          # stream_options.include_usage
    cache_scope: CacheScopeKey = CacheScopeKey()
    structured: tuple[StructuredOutputsParams, str] | None = None
    tools: ToolPlan | None = None
    moderation: ModerationConfig | None = None
    input_checks: list[dict[str, Any]] = field(default_factory=list)   # input moderation, for the trace
    priority: int = 0
    trace: bool = False                  # kvserve_trace requested
    prompt_token_texts: list[str] = field(default_factory=list)   # for the trace
    top_logprobs: int | None = None      # what the client asked for (None: no logprobs in the answer)
    echo: bool = False                   # completions: the prompt goes before the answer
    route: dict | None = None            # the router's decision, when it chose the model
    cache_key: CachePlan | None = None   # the semantic cache's key: the answer is stored under it
    cached: Hit | None = None            # a semantic-cache hit: the answer, with no engine request
    holds: list[Any] = field(default_factory=list)   # on-demand models' holds (routing/residency.py), until the lease ends
    candidate: Hit | None = None         # a semantic-cache hit the engine verifies (its draft), run as a miss
    headers: dict[str, str] = field(default_factory=dict)   # x-kvserve-* response headers
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"

    @property
    def n(self) -> int:
        return self.params.n if self.params is not None else 1

    @property
    def reserve_tokens(self) -> int:
        """The token reservation: each prompt plus max_tokens for every sequence."""
        if self.params is None:
            return 0
        return sum(len(p.token_ids) + self.params.max_tokens * self.params.num_sequences for p in self.prompts)


def check_before_load(gw: ServerState, record: RequestRecord, req: ChatCompletionRequest | CompletionRequest) -> None:
    """The gates that need no model, run before a model on demand is loaded or held: the caps (400),
    the length bound when the model is resident (400, context.py) and the key's tpm bound (429 when the answer's max_tokens alone, for every sequence, is more
    than the key's bucket holds now: the lease's reservation, prompt included, could not fit).
    Takes nothing from the bucket: the reservation is the lease's (lease.py)."""
    check_caps(req, gw.settings)
    engine = None
    with contextlib.suppress(KVServeError):        # resident models only: a name's own errors come later
        engine = gw.pool.entry(req.model).engine
    if engine is not None:                         # a chat that can never fit: 400 before any scan
        refuse_by_length(engine.tokenizer, req, engine.max_model_len)
    key = record.key
    max_tokens = req.requested_max_tokens()
    if key is not None and key.tpm is not None and max_tokens:
        sequences = max(req.n, req.best_of or 0, 1)
        gw.limiter.check_tokens(record.key_name, key.tpm, max_tokens * sequences)


def charge_load(gw: ServerState, record: RequestRecord, requested: str | None) -> None:
    """429 when the caller's key has started `--model-loads-per-minute` loads of models on demand in
    the last minute and this request would start another; else count this one. A load costs seconds of CPU
    and evicts idle models other keys use: a key cycling through a directory's models must not."""
    if record.key is None or record.key.name == CLI_KEY_NAME or not gw.pool.would_load(requested):
        return
    bucket, per_minute = f"{record.key_name}:model-loads", gw.settings.model_loads_per_minute   # ':': no key's name
    gw.limiter.refuse_if_empty(bucket, per_minute, f"Loads of models on demand for key {record.key_name!r}")
    gw.limiter.take_one(bucket, per_minute)


async def build_plan(gw: ServerState, record: RequestRecord, req: ChatCompletionRequest | CompletionRequest,
                     kind: Kind) -> GenerationPlan:
    """The plan for one validated request, every gate passed in order (see the module's docstring).
    The holds on models on demand are taken after the gates that need no model and given back here
    when a later gate refuses; from the plan's return on, the plan's `Lease` owns them."""
    check_before_load(gw, record, req)
    moderation = gw.moderation.config_for(record, req)    # input moderation, before any load or queue (400)
    checks = None
    shared: dict = {}     # the last message's embedding, made once for moderation, router and cache
    embedder = gw.routing.embedder
    fit_first = fits_before_moderation(req)
    if not has_token_prompts(req) and not fit_first:   # token ids are decoded by their model: after the load
        checks = await gw.moderation.check_input_async(req, record, moderation, None, embedder, shared)
    charge_load(gw, record, req.model)
    holds = [await gw.pool.acquire(req.model)]
    try:
        if checks is None:
            # personal data first, on every message: the fit then sees the redacted text
            checks = gw.moderation.screen_pii(req, record, moderation, input_texts(req)) if fit_first else []
            skip = await _dropped_turns(gw, record, req, shared) if fit_first else frozenset()
            checks += await gw.moderation.check_input_async(req, record, moderation, prompt_tokenizer(gw, req),
                                                            embedder, shared, skip=skip, pii=not fit_first)
        plan = await _build_plan(gw, record, req, kind, moderation, checks, shared.get("query"), shared.get("prompts"))
        if plan.route is not None:        # "auto": the model the router chose (resident: no wait)
            holds.append(await gw.pool.acquire(plan.model.name))
    except BaseException:
        for hold in holds:
            hold.release()
        raise
    plan.holds = holds
    return plan


FIT_FIRST_CHARS = 4_000   # a truncating chat past this is fitted to the window before it is moderated


def fits_before_moderation(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether input moderation waits for the prompt to be fitted to the window: a long chat with
    `truncate: "oldest"` is judged on the turns the model will read, not on the ones dropped (a
    255-turn conversation cut to its last few turns must not cost 255 turns of encoder forwards).
    Such a request holds its model before it is judged; a short chat is judged before any load."""
    if not isinstance(req, ChatCompletionRequest) or req.truncate != "oldest" or req.model == "auto":
        return False
    return sum(len(m.text()) for m in req.messages if m.content) > FIT_FIRST_CHARS


async def _dropped_turns(gw: ServerState, record: RequestRecord, req: ChatCompletionRequest,
                         shared: dict) -> frozenset[int]:
    """The indices of the messages `truncate: "oldest"` drops from `req` (the prompt is built here,
    once: it goes in `shared["prompts"]` for the plan). The template's k oldest droppable turns
    stand for at least the request's k oldest non-system turns (folding tool turns only merges
    them), so leaving those k out never skips a turn the model reads."""
    model = ModelHandle.resolve(gw, req.model, record.key_name)
    max_tokens = _capped_max_tokens(gw, record, req, {})
    tools = make_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    prompts = await asyncio.to_thread(build_prompts, model.tokenizer, req, max_model_len=model.max_model_len,
                                      max_tokens=max_tokens, tools=tools)
    shared["prompts"] = (model.name, max_tokens, prompts)
    droppable = [i for i, m in enumerate(req.messages[:-1]) if m.role not in ("system", "developer")]
    return frozenset(droppable[:prompts[0].dropped_messages])


async def _build_plan(gw: ServerState, record: RequestRecord, req: ChatCompletionRequest | CompletionRequest,
                      kind: Kind, moderation: ModerationConfig, checks: list[dict[str, Any]],
                      made: QueryEmbedding | None = None,
                      fitted: tuple[str, int | None, list[Prompt]] | None = None) -> GenerationPlan:
    chat = kind == "chat"
    timings = Timings(t0=record.t0, parsed=time.monotonic())
    requested, route, query = await gw.routing.route(req, kind, record.key_tier, made)
    query = query or made     # input moderation's embedding of the last message: the cache's when the text matches
    model = ModelHandle.resolve(gw, requested, record.key_name)
    headers: dict[str, str] = annotation_header(record)
    max_tokens = _capped_max_tokens(gw, record, req, headers)
    common: dict[str, Any] = {"kind": kind, "model": model, "timings": timings, "stream": bool(req.stream),
                              "include_usage": bool(req.stream and req.stream_options
                                                    and req.stream_options.include_usage),
                              "trace": bool(req.kvserve_trace), "route": route}
    hit, cache_key = await gw.routing.from_cache(req, kind, model.name, record.key_name, CAP_HEADER in headers,
                                                  query, moderation=moderation)
    if hit is not None and cache_key is None:     # verify off: served with no tokens computed
        return GenerationPlan(prompts=[Prompt(token_ids=[])], params=None, stages=list, cached=hit,
                              headers={CACHE_HEADER: "semantic"}, **common)
    if hit is not None:                           # the stored answer's tokens: the engine's draft
        headers[CACHE_HEADER] = "semantic"
        hit.draft = hit.entry.token_ids or await asyncio.to_thread(model.tokenizer.encode, hit.entry.answer,
                                                                    add_special_tokens=False)
    tools = make_plan(req.tools, req.tool_choice, req.parallel_tool_calls) if chat else None
    tok = model.tokenizer
    if fitted is not None and fitted[:2] == (model.name, max_tokens):    # built for input moderation
        prompts = fitted[2]
    else:
        prompts = await asyncio.to_thread(build_prompts, tok, req, max_model_len=model.max_model_len,
                                          max_tokens=max_tokens, tools=tools)
    if prompts[0].dropped_messages:
        headers[TRUNCATED_HEADER] = str(prompts[0].dropped_messages)
    texts = await asyncio.to_thread(token_texts, tok, prompts[0].token_ids) if req.kvserve_trace else []
    timings.tokenized = time.monotonic()
    if max_tokens is None:
        longest = max(len(p.token_ids) for p in prompts)
        max_tokens = min(gw.settings.default_max_tokens, model.max_model_len - longest)
    structured = for_request(req, tools)
    if structured is not None:    # compiled off the event loop, with a time limit (cached per grammar)
        await model.prepare_grammar(*structured)
    top = ((req.top_logprobs or 0) if req.logprobs else None) if chat else req.logprobs
    echo = not chat and bool(req.echo)
    params = to_sampling_params(req, max_tokens, logprobs=max(top or 0, 5) if req.kvserve_trace else top,
                                prompt_logprobs=req.logprobs if echo else None,
                                extra_stop=tools.stop if tools is not None else None,
                                structured=structured[0] if structured else None,
                                reasoning_budget=reasoning_budget(req))
    check_kv_budget(model, prompts, max_tokens, params.num_sequences)
    if req.stream and params.best_of is not None and params.best_of > params.n:
        raise InvalidRequest("best_of > n cannot be streamed; drop best_of or stream=false.", param="best_of")
    return GenerationPlan(
        prompts=prompts, params=params, headers=headers, structured=structured, tools=tools,
        stages=lambda: build_stages(tools, reasoning=chat, moderation=lambda: gw.moderation.output_stage(
            moderation, constrained=structured is not None and structured[1] != "tools", record=record)),
        cache_scope=CacheScopeKey(gw.cache_scope.salt(record.key, req.cache_salt), req.cache_salt),
        moderation=moderation, input_checks=checks, priority=engine_priority(record.key_tier, req.priority),
        prompt_token_texts=texts, top_logprobs=top, echo=echo, cache_key=cache_key, candidate=hit, **common)


def _capped_max_tokens(gw: ServerState, record: RequestRecord, req: ChatCompletionRequest | CompletionRequest,
                       headers: dict[str, str]) -> int | None:
    """The request's max_tokens under the degradation ladder's cap (and the header saying so)."""
    max_tokens = req.requested_max_tokens()
    cap = gw.admission.check(record.key_tier).max_tokens_cap
    if cap is not None and (max_tokens is None or max_tokens > cap):
        headers[CAP_HEADER] = str(cap)
        return cap
    return max_tokens


def check_kv_budget(model: ModelHandle, prompts: list[Prompt], max_tokens: int, num_sequences: int) -> None:
    """400 when a request's sequences together could never be resident in the KV cache at once
    (each prompt once, shared by its sequences, plus max_tokens for every sequence)."""
    capacity = model.kv_capacity_tokens()
    if not capacity:
        return
    need = sum(len(p.token_ids) + num_sequences * max_tokens for p in prompts)
    if need > capacity:
        raise InvalidRequest(f"This request needs room for {need} tokens (prompts + n x max_tokens) but the "
                             f"KV cache holds {capacity}; lower n, best_of or max_tokens.", param="max_tokens")


def prompt_tokenizer(server: ServerState, req: ChatCompletionRequest | CompletionRequest) -> Tokenizer | None:
    """The tokenizer that decodes a request's token-id prompts: its model's (the default model's
    for "auto"); None when there are none or the model cannot serve (the request fails later)."""
    if not has_token_prompts(req):
        return None
    try:
        return server.require_engine(None if req.model == "auto" else req.model)[0].tokenizer
    except KVServeError:
        return None
