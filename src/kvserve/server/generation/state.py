"""What came back: one generation's choices as the stage lists let them through, accumulated from
the run's deltas, and the numbers every renderer and the access log read from them (usage, the
log entry). The renderers write these into their own wire formats."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.outputs import PositionLogprobs, RequestMetrics, RequestOutput
from kvserve.server.generation.context import Prompt
from kvserve.server.generation.plan import GenerationPlan
from kvserve.server.records import GenerationLog
from kvserve.server.stages import ChoiceDelta, Stage
from kvserve.server.stages.tools import ParsedCall


def ended_with_calls(calls: list, reason: str | None) -> bool:
    """A choice's answer is its tool calls: it called tools and max_tokens did not cut it off (a
    cut-off call's arguments are not complete JSON, so it ends with "length", as in OpenAI's API)."""
    return bool(calls) and reason != "length"


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


@dataclass(frozen=True)
class Usage:
    """A request's token counts, as every API reports them in its own shape."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost: float | None = None             # at the model's configured price (usage.kvserve_cost)
    compute_tokens: int | None = None     # set (0) for a cached answer: no token was computed

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Generation:
    """One request's plan and what came back from running it, prompt by prompt, choice by choice."""

    plan: GenerationPlan
    prompts: list[PromptState]

    @classmethod
    def start(cls, plan: GenerationPlan) -> Generation:
        """`plan.n` choices per prompt, each with its own stage list."""
        states = [PromptState(p, f"{plan.id}-{i}", [ChoiceState(plan.stages()) for _ in range(plan.n)])
                  for i, p in enumerate(plan.prompts)]
        return cls(plan, states)

    @property
    def id(self) -> str:
        return self.plan.id

    @property
    def finished(self) -> bool:
        return all(ch.finish_reason is not None for ps in self.prompts for ch in ps.choices)

    def usage_counts(self) -> tuple[int, int, int]:
        """(prompt, completion, cached) tokens computed for this request (0s for a cached answer)."""
        if self.plan.cached is not None:
            return 0, 0, 0
        prompt = sum(len(ps.prompt.token_ids) for ps in self.prompts)
        completion = sum(len(ch.token_ids) for ps in self.prompts for ch in ps.choices)
        cached = sum(ps.num_cached for ps in self.prompts)
        return prompt, completion, cached

    def usage(self) -> Usage:
        hit = self.plan.cached
        if hit is not None:     # the counts of the answer when it was generated
            return Usage(hit.entry.prompt_tokens, hit.entry.completion_tokens, 0, compute_tokens=0)
        prompt, completion, cached = self.usage_counts()
        price = self.plan.model.cost_per_token
        return Usage(prompt, completion, cached,
                     cost=round((prompt + completion) * price, 8) if price is not None else None)

    def log(self, status: int, error: str | None) -> GenerationLog:
        """The access-log fields of this request."""
        prompt, completion, cached = self.usage_counts()
        ps = self.prompts[0]
        first = ps.choices[0]
        entry = GenerationLog(model=self.plan.model.name, completion_id=self.id, prompt_tokens=prompt,
                              completion_tokens=completion, cached_tokens=cached,
                              finish_reason="tool_calls" if ended_with_calls(first.calls, first.finish_reason) else first.finish_reason,
                              request_status=status, tool_calls=len(first.calls) or None, error=error)
        m = ps.metrics
        if m is not None and m.first_token_time is not None:
            sched = m.first_scheduled_time or m.arrival_time
            end = m.finished_time or m.last_token_time or m.first_token_time
            t = self.plan.timings
            entry.latency = {
                "queue_ms": round((t.gateway_wait_s + sched - m.arrival_time) * 1000, 2),
                "ttft_ms": round((m.first_token_time - t.t0) * 1000, 2),
                "tokens_per_s": round(len(first.token_ids) / (end - m.first_token_time), 2)
                if end > m.first_token_time else None}
        return entry
