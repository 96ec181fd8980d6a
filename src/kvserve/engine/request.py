"""A request as the engine tracks it: one sequence of tokens and how much of it is computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvserve.outputs import PositionLogprobs, RequestMetrics
from kvserve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generated sequence. A request with n > 1 has n of these (siblings); sibling 0
    prefills the prompt and the others start once that is done, so they find the prompt's
    full blocks in the prefix cache instead of computing them again.

    `num_computed_tokens` catches up with `num_tokens` under the scheduler's token budget:
    prompt chunks, cache hits and decode steps are all the same rule."""

    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_seq: int
    priority: int = 0
    cache_salt: str | None = None
    generator: torch.Generator | None = None
    wait_for: Sequence | None = None            # sibling whose prompt must be computed first
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1                 # prompt tokens found in the prefix cache (set once)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    detokenizer: object = None
    text: str = ""
    # what the last output carried, to build deltas
    sent_text_len: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: smaller priority value first, then arrival (FCFS), then sibling."""
        return (self.priority, self.arrival_seq, self.index)
