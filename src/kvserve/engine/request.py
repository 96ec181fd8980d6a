"""A request as the engine core tracks it: one sequence of tokens and how much of it is computed.

`num_computed_tokens` catches up with `num_tokens` under the scheduler's token budget: prompt
chunks, prefix-cache hits and decode steps are all the same rule. The scheduler owns this state
(it is the only writer); the KV cache manager owns the request's blocks; the model runner reads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.engine.messages import EngineCoreRequest
from kvserve.engine.sampler import make_generator
from kvserve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_seq: int
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    generator: torch.Generator | None = None
    wait_for: str | None = None                 # request whose prompt must be computed first
    want_prompt_logprobs: bool = False
    max_tokens: int | None = None               # smaller of params.max_tokens and the room in the window
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1                 # prompt tokens found in the prefix cache (set once)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    num_kv_blocks: int = 0                      # most KV blocks held at once
    first_scheduled_time: float | None = None
    cache_salt_from: int = 0                    # blocks ending at or before it are hashed without the salt
    grammar_future: Any = None                  # Future of the compiled grammar template (structured output)
    grammar: Any = None                         # this request's llguidance matcher, once admitted
    reasoning: Any = None                       # engine.reasoning.ReasoningState of a thinking request
    step_logprobs: list = field(default_factory=list)   # this step's TokenLogprobs (update_from_output)
    lora: Any = None                            # model.lora.LoRAAdapter this request runs under (None: base)
    supplied_draft: list[int] | None = None     # the expected continuation (draft_token_ids), until it diverges
    draft_min_logprob: float | None = None      # ... verified by likelihood when sampled (rejection.py)

    @property
    def grammar_active(self) -> bool:
        """A grammar constrains this request's next token (it has one, and is not reasoning)."""
        return self.grammar is not None and (self.reasoning is None or self.reasoning.done)

    @classmethod
    def from_core_request(cls, req: EngineCoreRequest, arrival_seq: int, max_model_len: int,
                          device: torch.device | str = "cpu") -> Request:
        room = max_model_len - len(req.prompt_token_ids)
        p = req.sampling_params
        return cls(req.request_id, list(req.prompt_token_ids), p, arrival_seq, req.arrival_time, req.priority,
                   req.cache_salt, make_generator(req.seed, device), req.wait_for, req.want_prompt_logprobs,
                   room if p.max_tokens is None else min(room, p.max_tokens),
                   cache_salt_from=req.cache_salt_from,
                   supplied_draft=list(req.draft_token_ids) if req.draft_token_ids else None,
                   draft_min_logprob=req.draft_min_logprob)

    def supplied_drafts(self) -> list[int]:
        """The rest of the supplied continuation while the output still follows it (each verified
        step keeps the accepted drafts plus one token; once a token differs it is dropped), cut so
        the drafts and the bonus token fit in max_tokens. A thinking request never takes them."""
        want = self.supplied_draft
        if want is None:
            return []
        n = len(self.output_token_ids)
        rest = want[n:] if self.output_token_ids == want[:n] and self.reasoning is None else []
        rest = rest[:max(0, (self.max_tokens or 0) - n - 1)]
        if not rest:
            self.supplied_draft = None
        return rest

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
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: smaller priority value first, then arrival (FCFS)."""
        return (self.priority, self.arrival_seq)
