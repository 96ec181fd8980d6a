"""What the engine hands back: vLLM-shaped request outputs, plus the deltas a stream needs
(the one outputs module; kvserve.engine.processing builds them).

A `RequestOutput` is cumulative (`text`, `token_ids` hold everything so far) and also carries
what is new since the previous output of the same request (`text_delta`, `token_ids_delta`,
`logprobs_delta`), so a streaming server never diffs strings itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token under the model's raw distribution (before temperature,
    penalties and truncation, as vLLM reports it), its 1-based rank, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per position: {token_id: Logprob} holding the chosen token and the top alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "repetition" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[PositionLogprobs] | None = None
    # per new token: an accepted draft token: False, or where its draft came from ("prompt", "request", "other", ...)
    drafted_delta: list[bool | str] = field(default_factory=list)


@dataclass
class RequestMetrics:
    """Per-request timestamps (time.monotonic() seconds) and counts, for metrics and traces."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_kv_blocks: int = 0          # KV blocks held at the last step (peak)
    num_preemptions: int = 0
    expert_tokens: list[int] | None = None   # MoE: tokens routed to each expert, summed over layers


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None          # set when the engine failed this request
