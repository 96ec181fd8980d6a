"""check_stop: EOS, stop_token_ids, min_tokens, ignore_eos, the repetition guard and length."""

from __future__ import annotations

from kvserve.engine.stop import check_stop, is_repeating
from kvserve.sampling_params import SamplingParams

EOS = [2, 0]


def test_eos_and_stop_token_ids():
    p = SamplingParams(stop_token_ids=[7])
    assert check_stop(p, [5, 6], EOS, 16) is None
    assert check_stop(p, [5, 2], EOS, 16) == ("stop", None)
    assert check_stop(p, [5, 0], EOS, 16) == ("stop", None)
    assert check_stop(p, [5, 7], EOS, 16) == ("stop", 7)
    assert check_stop(p, [], EOS, 16) is None


def test_min_tokens_and_ignore_eos():
    p = SamplingParams(min_tokens=3, stop_token_ids=[7])
    assert check_stop(p, [5, 2], EOS, 16) is None
    assert check_stop(p, [5, 7], EOS, 16) is None
    assert check_stop(p, [5, 6, 2], EOS, 16) == ("stop", None)
    ignore = SamplingParams(ignore_eos=True, stop_token_ids=[7])
    assert check_stop(ignore, [2, 2, 0], EOS, 16) is None
    assert check_stop(ignore, [2, 7], EOS, 16) == ("stop", 7)


def test_length():
    p = SamplingParams(max_tokens=3)
    assert check_stop(p, [5, 6], EOS, 3) is None
    assert check_stop(p, [5, 6, 8], EOS, 3) == ("length", None)
    assert check_stop(p, [5, 6, 2], EOS, 3) == ("stop", None)   # EOS wins over length
    assert check_stop(SamplingParams(max_tokens=None), list(range(10, 1000)), EOS, None) is None


def test_repetition_guard():
    assert is_repeating([1, 2, 3, 1, 2, 3, 1, 2, 3], window=3, repeats=3)
    assert not is_repeating([1, 2, 3, 1, 2, 3, 1, 2, 4], window=3, repeats=3)
    assert not is_repeating([1, 2, 3, 1, 2, 3, 1, 2, 3], window=2, repeats=3)   # period 3 > window
    assert is_repeating([9, 4, 4, 4, 4], window=3, repeats=4)
    assert not is_repeating([4, 4, 4], window=3, repeats=4)
    p = SamplingParams(repetition_guard={"window": 4, "repeats": 3}, max_tokens=100)
    out = [10, 11]
    for t in [21, 22, 23, 21, 22, 23, 21, 22]:
        out.append(t)
        assert check_stop(p, out, EOS, 100) is None
    out.append(23)
    assert check_stop(p, out, EOS, 100) == ("repetition", None)
    assert check_stop(SamplingParams(max_tokens=100), out, EOS, 100) is None   # off by default
