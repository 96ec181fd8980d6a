"""The client side of the engine boundary: prompts in, RequestOutputs out, in one place for every
driver (LLM, the CLI, the server's engine clients).

    InputProcessor:  prompt (text | ids) + SamplingParams -> validated EngineCoreRequests
                     (n / best_of fan out into child requests; children after the first wait for
                     its prompt so they share its prefix-cache blocks)
    OutputProcessor: EngineCoreOutputs -> RequestOutputs with text and deltas: incremental
                     detokenization, stop strings (a match finishes the request here and asks the
                     core to abort it), logprobs as {token_id: Logprob} with token texts,
                     best_of selection, per-request metrics. `process_ns` is its cumulative
                     time (the `output` phase of the server's profile).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvserve.engine.messages import EngineCoreOutputs, EngineCoreRequest, TokenLogprob
from kvserve.engine.reasoning_budget import END_TEXT
from kvserve.errors import ContextLengthExceeded, InvalidRequest
from kvserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.structured.grammar import compiler_for
from kvserve.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class EngineInfo:
    """What the client knows of the core it talks to."""

    model_name: str
    max_model_len: int
    block_size: int
    vocab_size: int
    kv_cache_limited: bool = False     # max_model_len is the KV pool's size, not the model's window


class EngineInfoView:
    """`model_name`, `max_model_len` and `block_size` of the engine a driver talks to, read from its
    `info` (the in-process LLMEngine and every EngineClient)."""

    info: EngineInfo

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def block_size(self) -> int:
        return self.info.block_size


class InputProcessor:
    def __init__(self, tokenizer, info: EngineInfo, enable_prefix_caching: bool = True):
        self.tokenizer = tokenizer
        self.info = info
        self.enable_prefix_caching = enable_prefix_caching

    def prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise InvalidRequest("a prompt is a string, a list of token ids or {'prompt_token_ids': [...]}",
                             param="prompt")

    def requests(self, request_id: str, ids: list[int], params: SamplingParams, *, priority: int = 0,
                 cache_salt: str | None = None, cache_salt_from: int = 0,
                 arrival_time: float | None = None, lora_name: str | None = None) -> list[EngineCoreRequest]:
        """Validate and fan out into the core's requests (one per generated sequence)."""
        info = self.info
        if not ids:
            raise InvalidRequest("the prompt is empty: give at least one token", param="prompt")
        bad = [t for t in ids if not 0 <= t < info.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary "
                                 f"(0..{info.vocab_size - 1})", param="prompt")
        for name, toks in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids or ())):
            bad = [t for t in toks if t >= info.vocab_size]
            if bad:
                raise InvalidRequest(f"{name} holds token id {bad[0]}, outside the vocabulary "
                                     f"(0..{info.vocab_size - 1})", param=name)
        room = info.max_model_len - len(ids)
        if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
            limit = (f"the KV cache (kv_cache_memory) holds at most {info.max_model_len} tokens per sequence"
                     if info.kv_cache_limited else
                     f"this model's maximum context length is {info.max_model_len} tokens")
            raise ContextLengthExceeded(
                f"{limit}; the prompt has {len(ids)} tokens and max_tokens asks for {params.max_tokens} more: "
                "shorten the prompt or lower max_tokens", param="max_tokens" if room >= 1 else "prompt")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        structured = None
        if params.structured_outputs is not None:   # compiled once per grammar text (cached)
            structured = {"grammar": self.grammar_compiler().prepare(params.structured_outputs)}
        end_ids = None
        if params.reasoning_budget is not None:
            end_ids = self.tokenizer.encode(END_TEXT, add_special_tokens=False)
        n = params.num_sequences
        out = []
        for i in range(n):
            rid = request_id if n == 1 else f"{request_id}#{i}"
            out.append(EngineCoreRequest(
                request_id=rid, prompt_token_ids=ids, sampling_params=params, arrival_time=arrival,
                priority=priority, cache_salt=cache_salt, cache_salt_from=cache_salt_from, seed=None if params.seed is None else params.seed + i,
                wait_for=out[0].request_id if i and self.enable_prefix_caching else None,
                want_prompt_logprobs=params.prompt_logprobs is not None and i == 0, structured_output=structured,
                reasoning_end_ids=end_ids, lora_name=lora_name))
        return out

    def grammar_compiler(self):
        """The structured-output compiler for this tokenizer (kvserve.structured.grammar)."""
        return compiler_for(self.tokenizer, self.info.vocab_size)


@dataclass(eq=False)
class _Child:
    """One generated sequence of a request, as the client sees it."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    # per token: an accepted draft token (speculation): False, or where its draft came from (a str)
    drafted: list[bool | str] = field(default_factory=list)


@dataclass(eq=False)
class _State:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, _Child]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _State] = {}
        self.parent_of: dict[str, str] = {}     # core request id -> client request id
        self.process_ns = 0                     # time spent in process(), always measured

    def add(self, request_id: str, prompt: str | None, core_requests: list[EngineCoreRequest]) -> None:
        first = core_requests[0]
        params, ids = first.sampling_params, first.prompt_token_ids
        children = {}
        for i, cr in enumerate(core_requests):
            detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                                           stop=params.stop_strings,
                                           include_stop_str_in_output=params.include_stop_str_in_output)
            children[cr.request_id] = _Child(i, detok, logprobs=[] if params.logprobs is not None else None)
            self.parent_of[cr.request_id] = request_id
        m = RequestMetrics(arrival_time=first.arrival_time, num_prompt_tokens=len(ids))
        self.requests[request_id] = _State(request_id, prompt, ids, params, children, m,
                                           [None] if params.prompt_logprobs is not None else None)

    def core_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return [] if state is None else [cid for cid, c in state.children.items() if c.finish_reason is None]

    # ---- outputs ------------------------------------------------------------------------------
    def process(self, outs: EngineCoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        """RequestOutputs for the requests these outputs touched, and the core request ids to abort
        (their text hit a stop string)."""
        t0 = time.perf_counter_ns()
        touched: dict[str, _State] = {}
        to_abort: list[str] = []
        now = outs.timestamp
        for o in outs.outputs:
            parent = self.parent_of.get(o.request_id)
            state = self.requests.get(parent) if parent is not None else None
            if state is None:
                continue
            child = state.children[o.request_id]
            if child.finish_reason is not None:
                continue            # finished here (stop string) while the core still ran it
            m = state.metrics
            if o.first_scheduled_time is not None and m.first_scheduled_time is None:
                m.first_scheduled_time = o.first_scheduled_time
            if child.index == 0:
                state.num_cached_tokens = o.num_cached_tokens
                m.num_cached_tokens = o.num_cached_tokens
            m.num_kv_blocks = max(m.num_kv_blocks, o.num_kv_blocks)
            m.num_preemptions = max(m.num_preemptions, o.num_preemptions)
            if o.expert_tokens is not None:
                m.expert_tokens = o.expert_tokens if m.expert_tokens is None else [
                    a + b for a, b in zip(m.expert_tokens, o.expert_tokens)]
            if o.new_prompt_logprobs:
                self._prompt_logprobs(state, o.prompt_logprobs_start, o.new_prompt_logprobs)
            if o.error is not None:
                state.error = o.error
            if o.new_token_ids:
                self._add_tokens(child, o.new_token_ids, o.new_logprobs, self._ends_on_stop_token(o, state.params))
                child.drafted += [(o.draft_source or True) if i < o.num_drafted else False
                                  for i in range(len(o.new_token_ids))]
                child.cumulative_logprob = o.cumulative_logprob
                if m.first_token_time is None:
                    m.first_token_time = now
                m.last_token_time = now
                m.token_times += [now] * len(o.new_token_ids)
                m.num_output_tokens += len(o.new_token_ids)
            if child.detokenizer.stop_reason is not None:
                child.finish_reason, child.stop_reason = "stop", child.detokenizer.stop_reason
                if o.finish_reason is None:
                    to_abort.append(o.request_id)
            elif o.finish_reason is not None:
                child.finish_reason, child.stop_reason = o.finish_reason, o.stop_reason
            if child.finish_reason is not None:
                child.text += child.detokenizer.flush()
                self.parent_of.pop(o.request_id, None)
            touched[state.request_id] = state
        results = []
        for rid, state in touched.items():
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[rid]
            results.append(self._request_output(state))
        self.process_ns += time.perf_counter_ns() - t0
        return results, to_abort

    def _ends_on_stop_token(self, o, params: SamplingParams) -> bool:
        """The last new token is the EOS / stop token that ended the request (its text is left
        out); a request that ended because its grammar was complete keeps its last token."""
        if o.finish_reason != "stop" or not o.new_token_ids:
            return False
        last = o.new_token_ids[-1]
        return last in self.tokenizer.eos_token_ids or last in (params.stop_token_ids or ())

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request on the client side (the caller aborts its core requests)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for cid, c in state.children.items():
            self.parent_of.pop(cid, None)
            if c.finish_reason is None:
                c.finish_reason = "abort"
        state.metrics.finished_time = time.monotonic()
        return self._request_output(state)

    def _add_tokens(self, child: _Child, ids: list[int], lps: list[TokenLogprob] | None, stopped: bool) -> None:
        child.token_ids += ids
        child.text += child.detokenizer.add_tokens(ids, stop_terminated=stopped)
        if child.logprobs is not None and lps:
            child.logprobs += [self._position(e) for e in lps]

    def _position(self, e: TokenLogprob) -> PositionLogprobs:
        """{token_id: Logprob} for the chosen token plus the top alternatives (ranks 1..k)."""
        text = self.tokenizer.token_text
        d: PositionLogprobs = {e.token_id: Logprob(e.logprob, e.rank, text(e.token_id))}
        for r, (tid, lp) in enumerate(zip(e.top_token_ids, e.top_logprobs), start=1):
            if tid not in d:
                d[tid] = Logprob(lp, r, text(tid))
        return d

    def _prompt_logprobs(self, state: _State, start: int, entries: list[TokenLogprob]) -> None:
        for j, e in enumerate(entries):
            if len(state.prompt_logprobs) > start + 1 + j:
                continue   # already recorded before a preemption
            state.prompt_logprobs.append(self._position(e))

    def _request_output(self, state: _State) -> RequestOutput:
        children = list(state.children.values())
        n = state.params.n
        if len(children) > n:   # best_of: only the n most likely sequences, once all are done
            chosen = (sorted(children, key=lambda c: c.cumulative_logprob, reverse=True)[:n]
                      if state.finished else [])
        else:
            chosen = children
        state.metrics.num_output_tokens = sum(len(c.token_ids) for c in children)
        outputs = [self._completion(c, i) for i, c in enumerate(chosen)]
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=outputs, finished=state.finished,
                             num_cached_tokens=state.num_cached_tokens, prompt_logprobs=state.prompt_logprobs,
                             metrics=state.metrics, error=state.error)

    @staticmethod
    def _completion(c: _Child, index: int) -> CompletionOutput:
        text_delta, tok_delta = c.text[c.sent_text:], c.token_ids[c.sent_tokens:]
        lp_delta = None if c.logprobs is None else c.logprobs[c.sent_logprobs:]
        c.sent_text, c.sent_tokens = len(c.text), len(c.token_ids)
        c.sent_logprobs = 0 if c.logprobs is None else len(c.logprobs)
        return CompletionOutput(index=index, text=c.text, token_ids=list(c.token_ids),
                                cumulative_logprob=c.cumulative_logprob, logprobs=c.logprobs,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason, text_delta=text_delta,
                                token_ids_delta=tok_delta, logprobs_delta=lp_delta,
                                drafted_delta=c.drafted[len(c.token_ids) - len(tok_delta):])
