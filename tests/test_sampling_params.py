"""SamplingParams: vLLM defaults, normalisation, and errors that name the offending field."""

from __future__ import annotations

import pytest

from kvserve.errors import InvalidRequest
from kvserve.sampling_params import MAX_LOGPROBS, RepetitionGuard, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_k, p.top_p, p.min_p) == (1, None, 1.0, 0, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, None, None)
    assert (p.logprobs, p.prompt_logprobs, p.seed, p.logit_bias) == (None, None, None, None)
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.use_beam_search and p.length_penalty == 1.0 and p.repetition_guard is None
    assert MAX_LOGPROBS == 20
    assert not p.greedy and SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 0}, "n"),
    ({"n": 2.5}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {5: -100.5}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {1.5: 1}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"seed": "x"}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ({"length_penalty": float("inf")}, "length_penalty"),
    ({"repetition_guard": {"window": 0, "repeats": 3}}, "repetition_guard"),
    ({"repetition_guard": {"window": 4, "repeats": 1}}, "repetition_guard"),
    ({"repetition_guard": {"size": 4}}, "repetition_guard"),
    ({"repetition_guard": 7}, "repetition_guard"),
])
def test_invalid_values_raise_with_the_field_name(kwargs, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert param.split("_")[0] in e.value.message
    assert e.value.to_dict()["error"]["param"] == param


def test_boundaries_that_are_allowed():
    p = SamplingParams(temperature=0, top_k=-1, top_p=1.0, min_p=1.0, logprobs=0, prompt_logprobs=20,
                       presence_penalty=-2, frequency_penalty=2, logit_bias={0: -100, 7: 100},
                       max_tokens=None, seed=-3, n=2, best_of=2, min_tokens=5)
    assert p.num_sequences == 2 and p.max_tokens is None


def test_normalisation():
    p = SamplingParams(stop="###", logit_bias={"50": 2, 3: -1.5}, stop_token_ids=(4, 5),
                       repetition_guard=(8, 3))
    assert p.stop_strings == ["###"] and p.max_stop_len == 3
    assert p.logit_bias == {50: 2.0, 3: -1.5}     # JSON keys arrive as strings
    assert p.stop_token_ids == [4, 5]
    assert p.repetition_guard == RepetitionGuard(window=8, repeats=3)
    assert SamplingParams(repetition_guard={"window": 2, "repeats": 5}).repetition_guard == RepetitionGuard(2, 5)
    assert SamplingParams(stop=["a", "bcd"]).max_stop_len == 3
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(n=3).num_sequences == 3 and SamplingParams(n=2, best_of=5).num_sequences == 5
