"""kvserve's extension fields map onto SamplingParams (no server needed)."""

import pytest

from kvserve.errors import InvalidRequest
from kvserve.server.protocol import ChatCompletionRequest, to_sampling_params


def _req(**kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_repetition_guard_field():
    sp = to_sampling_params(_req(repetition_guard={"window": 4, "repeats": 3}), 16, logprobs=None)
    assert sp.repetition_guard.window == 4 and sp.repetition_guard.repeats == 3
    assert to_sampling_params(_req(), 16, logprobs=None).repetition_guard is None


def test_repetition_guard_validated():
    with pytest.raises(InvalidRequest) as e:
        to_sampling_params(_req(repetition_guard={"window": 0, "repeats": 3}), 16, logprobs=None)
    assert e.value.param == "repetition_guard"
