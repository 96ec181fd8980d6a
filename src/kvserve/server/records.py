"""Typed per-request records: what the gateway knows about one HTTP request, passed explicitly.

* `RequestRecord`: made by the middleware for every HTTP request (id, arrival time, caller) and
  written to the access log when the response is done. A generation handler attaches a
  `GenerationLog` to it: that is the only way a handler adds fields to the access log.
* `Generation`: one generation request's state: its prompts, the choices accumulated from the
  engine's deltas (after the stage list), the gateway's own `Timings`, and what it holds
  (admission ticket, token reservation) until `handlers._release` gives it back.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvserve.outputs import PositionLogprobs, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.admission import Ticket
from kvserve.server.context import Prompt
from kvserve.server.stages import ChoiceDelta, Stage
from kvserve.server.stores.keys import ApiKey
from kvserve.server.tools import ParsedCall


@dataclass
class GenerationLog:
    """The access-log fields a generation request adds (in this order)."""

    model: str
    completion_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None
    request_status: int
    tool_calls: int | None = None         # written only when the first choice called tools
    error: str | None = None              # written only when set
    latency: dict[str, float | None] | None = None   # queue_ms, ttft_ms, tokens_per_s once a token came

    def fields(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("tool_calls", "error", "latency")}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.error:
            out["error"] = self.error
        out.update(self.latency or {})
        return out


@dataclass
class RequestRecord:
    """One HTTP request as the gateway saw it; the middleware makes it and writes the log line."""

    request_id: str
    t0: float                       # time.monotonic() at arrival
    method: str | None
    path: str
    key: ApiKey | None = None       # the caller's key; None when auth is off
    key_name: str | None = None
    key_tier: str = "paid"
    status: int = 500               # the HTTP status sent
    generation: GenerationLog | None = None
    moderation: dict[str, Any] | None = None   # the input check's verdict (server/moderation.py)

    def access_log_line(self) -> str:
        line: dict[str, Any] = {"ts": round(time.time(), 3), "request_id": self.request_id,
                                "method": self.method, "path": self.path, "status": self.status,
                                "key_name": self.key_name}
        if self.generation is not None:
            line.update(self.generation.fields())
        if self.moderation is not None:
            line["moderation"] = self.moderation
        line["total_ms"] = round((time.monotonic() - self.t0) * 1000, 2)
        return json.dumps(line)


@dataclass
class Timings:
    """The gateway's own marks (time.monotonic() seconds) for the trace and the access log."""

    t0: float                   # request arrived
    parsed: float = 0.0         # body validated
    tokenized: float = 0.0      # template + tokenize done
    gateway_wait_s: float = 0.0  # time spent in the admission queue


@dataclass
class ChoiceState:
    """One choice as sent so far: the stage list's output accumulated, plus the raw tokens."""

    stages: list[Stage]
    content: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None       # the engine's reason ("repetition", "abort", ...)
    stop_reason: int | str | None = None
    calls: list[ParsedCall] = field(default_factory=list)
    reasoning: str = ""                    # the `<think>` block's text (ReasoningStage)
    reasoning_tokens: int = 0
    drafted: list[bool] = field(default_factory=list)   # per token: an accepted draft token

    def add(self, d: ChoiceDelta) -> ChoiceDelta:
        """Accumulate one step (as the stages left it); returns it."""
        self.content += d.text
        self.reasoning += d.reasoning
        self.reasoning_tokens = max(self.reasoning_tokens, d.reasoning_tokens)
        self.token_ids.extend(d.token_ids)
        self.drafted.extend(d.drafted)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.done:
            self.finish_reason, self.stop_reason, self.calls = d.finish_reason, d.stop_reason, d.calls
        return d


@dataclass
class PromptState:
    """One prompt of the request: one engine request, `n` choices."""

    prompt: Prompt
    request_id: str
    choices: list[ChoiceState]
    final: RequestOutput | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def metrics(self) -> RequestMetrics | None:
        return self.final.metrics if self.final is not None else None

    @property
    def num_cached(self) -> int:
        if self.final is None:
            return 0
        return self.final.num_cached_tokens or (self.final.metrics.num_cached_tokens if self.final.metrics else 0)


@dataclass
class Generation:
    """What one generation request holds from its admission to its last byte."""

    kind: str                       # "chat" | "completion"
    model_name: str
    params: SamplingParams
    timings: Timings
    prompts: list[PromptState]
    top_logprobs: int | None        # what the client asked for (None: no logprobs in the answer)
    trace: bool                     # kvserve_trace requested
    priority: int = 0
    engine: Any = None              # the EngineClient serving it (the model pool's resolve)
    cost_per_token: float | None = None   # the model's configured price: usage.kvserve_cost
    cache_plan: Any = None          # the semantic cache's key (features.py); stored on success
    trace_extra: dict = field(default_factory=dict)   # e.g. the router's decision
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_token_texts: list[str] = field(default_factory=list)   # for the trace
    ticket: Ticket | None = None
    reserved_tokens: int = 0
    streams: list[AsyncIterator[RequestOutput]] = field(default_factory=list)   # engine.generate() per prompt
    tasks: list[asyncio.Task] = field(default_factory=list)   # pumps merging several prompts' streams
    moderation: list[dict[str, Any]] = field(default_factory=list)   # input checks, for the trace
    started: bool = False           # engine requests were sent
    released: bool = False

    @classmethod
    def create(cls, kind: str, prompts: list[Prompt], params: SamplingParams,
               stages: Callable[[], list[Stage]], **kw: Any) -> Generation:
        """A new request with `params.n` choices per prompt; `stages()` makes one choice's stage list."""
        gid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        states = [PromptState(p, f"{gid}-{i}", [ChoiceState(stages()) for _ in range(params.n)])
                  for i, p in enumerate(prompts)]
        return cls(kind=kind, params=params, prompts=states, id=gid, **kw)

    def usage_counts(self) -> tuple[int, int, int]:
        prompt = sum(len(ps.prompt.token_ids) for ps in self.prompts)
        completion = sum(len(ch.token_ids) for ps in self.prompts for ch in ps.choices)
        cached = sum(ps.num_cached for ps in self.prompts)
        return prompt, completion, cached

    def usage_extra(self) -> dict:
        """Usage fields beyond OpenAI's: the cost at the model's configured price per token."""
        if self.cost_per_token is None:
            return {}
        prompt, completion, _ = self.usage_counts()
        return {"kvserve_cost": round((prompt + completion) * self.cost_per_token, 8)}

    def log(self, status: int, error: str | None) -> GenerationLog:
        prompt, completion, cached = self.usage_counts()
        ps = self.prompts[0]
        first = ps.choices[0]
        entry = GenerationLog(model=self.model_name, completion_id=self.id, prompt_tokens=prompt,
                              completion_tokens=completion, cached_tokens=cached,
                              finish_reason="tool_calls" if first.calls else first.finish_reason,
                              request_status=status, tool_calls=len(first.calls) or None, error=error)
        m = ps.metrics
        if m is not None and m.first_token_time is not None:
            sched = m.first_scheduled_time or m.arrival_time
            end = m.finished_time or m.last_token_time or m.first_token_time
            entry.latency = {
                "queue_ms": round((self.timings.gateway_wait_s + sched - m.arrival_time) * 1000, 2),
                "ttft_ms": round((m.first_token_time - self.timings.t0) * 1000, 2),
                "tokens_per_s": round(len(first.token_ids) / (end - m.first_token_time), 2)
                if end > m.first_token_time else None}
        return entry
