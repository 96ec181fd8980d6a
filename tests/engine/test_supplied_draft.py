"""A request's own draft (EngineCoreRequest.draft_token_ids, the semantic cache's verification):
verified by the rejection sampler like a proposer's drafts, on the default model.

- greedy: with the request's own answer as the draft, the answer comes back token for token in one
  step (the prompt's last chunk and the draft in one forward); with a draft wrong from some token on, the
  verified prefix is kept and decoding continues to the same answer;
- sampled: the answer is the model's (ends normally), whatever the draft;
- sampled with `draft_min_logprob`: the draft is kept by likelihood (whole when every token clears
  the threshold, nothing when none can);
- the engine without a proposer (no --speculative) takes them; every block is back in the pool;
- with --speculative on, a request whose own draft is still pending (a draft longer than a step's
  budget spans several steps) is never offered to the proposer, its answer is the same, and once its
  output leaves the draft it is an ordinary decode the proposer drafts for again;
- the fields cross the process boundary (msgpack).
"""

from __future__ import annotations

import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.messages import EngineCoreRequest, decode_input, encode


@pytest.fixture(scope="module")
def llm(loaded) -> LLM:
    return LLM(loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory="128MiB")


def run(llm: LLM, prompt: list[int], params: SamplingParams, draft: list[int] | None, rid: str,
        min_logprob: float | None = None):
    core = llm.engine.core
    core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params,
                                       arrival_time=time.monotonic(), draft_token_ids=draft,
                                       draft_min_logprob=min_logprob))
    tokens, steps, drafted = [], 0, 0
    while True:
        steps += 1
        for o in core.step().outputs:
            if o.request_id == rid:
                tokens += o.new_token_ids
                drafted += o.num_drafted
                if o.finish_reason:
                    return tokens, steps, drafted, o.finish_reason


def test_greedy_draft_verified_whole_or_from_its_first_wrong_token(llm):
    question = "Why is the sky blue? Answer in two sentences."
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=True)
    greedy = SamplingParams(temperature=0, max_tokens=40)
    own = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0]
    answer = list(own.token_ids)
    tokens, steps, drafted, finish = run(llm, prompt, greedy, answer, "whole-" + question)
    assert tokens == answer and finish == own.finish_reason
    # one forward: the prompt's last chunk and the draft (the last token is the bonus when max_tokens ends it)
    assert steps == 1 and drafted == len(answer) - (0 if finish == "stop" else 1)
    wrong = answer[:6] + [tok.encode(" banana", add_special_tokens=False)[0]] + answer[7:]
    tokens, steps, drafted, finish = run(llm, prompt, greedy, wrong, "wrong-" + question)
    assert tokens == answer and drafted == 6 and steps > 2
    tokens, _, _, finish = run(llm, prompt, SamplingParams(temperature=0.8, max_tokens=40), answer, "s-" + question)
    assert finish in ("stop", "length") and 0 < len(tokens) <= 40
    core = llm.engine.core
    assert core.kv.num_free_blocks == core.kv.num_blocks and not core.scheduler.requests


def greedy_answer(llm: LLM, question: str, max_tokens: int = 40) -> tuple[list[int], list[int]]:
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": question}], tokenize=True)
    own = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=max_tokens),
                       use_tqdm=False)[0].outputs[0]
    return prompt, list(own.token_ids)


def test_sampled_draft_kept_by_likelihood(llm):
    prompt, answer = greedy_answer(llm, "Name three primary colours.")
    assert len(answer) < 40                                     # it ends with EOS: the draft holds all of it
    sampled = SamplingParams(temperature=0.8, max_tokens=40)
    tokens, steps, drafted, finish = run(llm, prompt, sampled, answer, "lik-all", min_logprob=-1e9)
    assert tokens == answer and steps == 1 and finish == "stop"  # every token clears it: served whole
    tokens, _, drafted, _ = run(llm, prompt, sampled, answer, "lik-none", min_logprob=1.0)
    assert drafted == 0 and 0 < len(tokens) <= 40                # none can: decoded from the first token
    core = llm.engine.core
    assert core.kv.num_free_blocks == core.kv.num_blocks and not core.scheduler.requests


def test_speculative_proposer_skips_a_request_with_its_own_draft(loaded):
    spec_llm = LLM(loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory="128MiB", max_num_batched_tokens=16,
                   speculative={"method": "ngram", "max_batch_rows": 0}, num_speculative_tokens=3)
    prompt, answer = greedy_answer(spec_llm, "Repeat after me: one two three, one two three, one two three.")
    spec = spec_llm.engine.core.scheduler.spec
    asked: list[str] = []
    propose = spec.propose

    def recording(reqs, cost=None):
        asked.extend(r.request_id for r in reqs)
        return propose(reqs, cost)

    spec.propose = recording
    greedy = SamplingParams(temperature=0, max_tokens=len(answer))
    core = spec_llm.engine.core
    core.add_request(EngineCoreRequest(request_id="own", prompt_token_ids=prompt, sampling_params=greedy,
                                       arrival_time=time.monotonic(), draft_token_ids=answer))
    tokens, per_step, finished = [], [], False      # per_step: the draft's tokens kept in each step
    while not finished:
        for o in core.step().outputs:
            if o.request_id == "own":
                tokens += o.new_token_ids
                per_step.append(o.num_drafted)
                finished = bool(o.finish_reason)
    # a step's budget (16) cannot hold it whole: it is still pending in a decode step after the prompt's
    assert sum(d > 0 for d in per_step) >= 2, per_step
    assert tokens == answer and sum(per_step) + len(per_step) == len(answer) and "own" not in asked   # + a bonus each
    wrong = answer[:4] + [(answer[4] + 1) % 1000] + answer[5:]
    tokens, *_ = run(spec_llm, prompt, greedy, wrong, "left")
    assert tokens == answer and "left" in asked       # after its draft diverged: an ordinary decode
    assert core.kv.num_free_blocks == core.kv.num_blocks and not core.scheduler.requests


def test_draft_token_ids_cross_the_process_boundary():
    req = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams(),
                            arrival_time=0.0, draft_token_ids=[3, 4, 5], draft_min_logprob=-2.5)
    got = decode_input(encode(req))
    assert got.draft_token_ids == [3, 4, 5] and got.draft_min_logprob == -2.5
