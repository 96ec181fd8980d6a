"""The engine's typed seams: what crosses from the client to the core, from the scheduler to the
model runner, and back.

    client ──EngineCoreRequest──▶ EngineCore.add_request
                                  EngineCore.step():
                                    Scheduler.schedule()            ─▶ SchedulerOutput
                                    ModelRunner.execute(...)        ─▶ ModelRunnerOutput
                                    Scheduler.update_from_output()  ─▶ EngineCoreOutputs
    client ◀──EngineCoreOutputs──

Messages that may cross a process boundary (requests, outputs, control messages) are msgspec
Structs, serialized as msgpack; nothing is pickled. SchedulerOutput and ModelRunnerOutput stay
inside the core's process and hold plain Python objects; the runner only reads the `Request`
objects a SchedulerOutput points at.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.request import Request


# ---- client -> core ---------------------------------------------------------------------------

class EngineCoreRequest(msgspec.Struct, tag="add", kw_only=True):
    """One sequence to generate. A client request with n > 1 (or best_of) becomes that many
    EngineCoreRequests; the children after the first name it in `wait_for`, so they start once its
    prompt is in the prefix cache and share those blocks instead of computing them again."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0                      # smaller runs first
    cache_salt: str | None = None          # isolates this request's prefix-cache entries
    cache_salt_from: int = 0               # blocks wholly before this token are hashed unsalted (shared)
    seed: int | None = None                # this sequence's own seed (params.seed + child index)
    wait_for: str | None = None            # request id whose prompt must be computed first
    want_prompt_logprobs: bool = False     # only one child of a request reports them
    structured_output: dict | None = None  # {"grammar": llguidance grammar text} (kvserve.structured)
    reasoning_end_ids: list[int] | None = None  # with params.reasoning_budget: the tokens that close <think>
    lora_name: str | None = None           # the LoRA adapter this sequence runs under (None: the base)
    # A continuation the caller expects (a semantic-cache answer): scheduled behind the prompt's last
    # chunk as draft tokens and verified by the rejection sampler; the output is the model's own.
    draft_token_ids: list[int] | None = None
    # With draft_token_ids, a sampled request keeps a draft token while the model's raw logprob of it
    # is >= this (spec_decode/rejection.py); None: the exact rejection rule.
    draft_min_logprob: float | None = None


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


CoreInput = EngineCoreRequest | AbortRequests | Shutdown


# ---- core -> client ---------------------------------------------------------------------------

class TokenLogprob(msgspec.Struct, array_like=True):
    """Raw log-probability of one token (before penalties, temperature and truncation), its 1-based
    rank, and the top alternatives (empty unless the request asked for k > 0)."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request got in one step: new tokens (more than one when speculating), their
    logprobs when asked, prompt logprobs for the positions computed this step, and how it ended."""

    request_id: str
    new_token_ids: list[int]
    cumulative_logprob: float = 0.0
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs_start: int = 0                      # prompt position of the first entry below
    new_prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None   # "stop" (EOS / stop token), "length", "repetition", "abort", "error"
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    num_kv_blocks: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    expert_tokens: list[int] | None = None       # MoE: tokens routed to each expert since the last output
    num_drafted: int = 0                         # the first this many new tokens were accepted draft tokens
    # ... and where their draft came from: "prompt", "request" (its own output), "other" (another
    # request's answer, suffix decoding), "model" (a draft model), "supplied" (draft_token_ids)
    draft_source: str = ""


class EngineCoreOutputs(msgspec.Struct, tag="out", array_like=True, omit_defaults=True):
    timestamp: float
    outputs: list[EngineCoreOutput] = []
    stats: dict | None = None


class EngineReady(msgspec.Struct, tag="ready", array_like=True, kw_only=True):
    """First message of an engine process: what the client needs to know about the model."""

    model_name: str
    max_model_len: int
    block_size: int
    vocab_size: int
    kv_cache_limited: bool
    enable_prefix_caching: bool
    tokenizer: dict          # kvserve.engine.process.tokenizer_spec


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str


# ---- scheduler -> runner -> scheduler (in process) ---------------------------------------------

@dataclass
class ScheduledRequest:
    """One request's share of a step: compute tokens [num_computed_tokens, +num_new_tokens)."""

    request: Request                 # read-only for the runner
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    spec_token_ids: list[int] = field(default_factory=list)   # proposer slot (speculative decoding)
    supplied_draft: bool = False           # spec_token_ids came with the request (draft_token_ids), not a proposer
    grammar_bitmask_slot: int | None = None                    # row in the step's grammar bitmask
    local_block_ids: list[int] | None = None                   # the sliding layers' table (kv_hybrid.py)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0
    num_grammar_rows: int = 0            # rows of the step's grammar bitmask

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class ModelRunnerOutput:
    """Per request that reached the end of its known tokens this step: the sampled token ids
    (a list, longer than one when draft tokens were accepted) and, when asked, their logprobs."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)    # parallel to req_ids
    # request id -> (first prompt position, entries) for prompt positions computed this step
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # MoE models: request id -> tokens routed to each expert this step (summed over layers)
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)


# ---- wire format ------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(CoreInput)
_output_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs | EngineReady | EngineFailed)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_input(data: bytes) -> CoreInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> EngineCoreOutputs | EngineReady | EngineFailed:
    return _output_decoder.decode(data)


def poll_queue(inbox, timeout: float) -> list[CoreInput]:
    """The busy loop's `poll` over a thread queue: everything pending, waiting up to `timeout`
    seconds for the first message when none is (0: do not wait)."""
    msgs = []
    try:
        msgs.append(inbox.get(timeout=timeout) if timeout > 0 else inbox.get_nowait())
        while True:
            msgs.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return msgs
