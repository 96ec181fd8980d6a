"""logit_bias and the token masks as tensors built once per request: the same logits as the
per-entry Python walk they replace, and no per-step work that grows with the maps."""

from __future__ import annotations

import random

import torch

from kvserve.engine import sampler as sampler_mod
from kvserve.engine.sampler import Sampler, SamplingRequest
from kvserve.sampling_params import SamplingParams

V = 1000
EOS = [2, 7]


def walked(logits: torch.Tensor, reqs: list[SamplingRequest]) -> torch.Tensor:
    """The logits as the per-row, per-entry walk computed them."""
    out = logits.float().clone()
    for i, r in enumerate(reqs):
        p = r.params
        for tok, b in (p.logit_bias or {}).items():
            if tok < V:
                out[i, tok] += torch.tensor(b, dtype=torch.float32)
        banned = list(EOS) if p.ignore_eos else []
        if len(r.output_token_ids) < p.min_tokens or r.in_reasoning:
            banned += [] if p.ignore_eos else EOS
            banned += p.stop_token_ids or []
        for tok in banned:
            if tok < V:
                out[i, tok] = float("-inf")
    return out


def random_request(rng: random.Random) -> SamplingRequest:
    bias = ({rng.randrange(V + 50): rng.uniform(-100, 100) for _ in range(rng.randint(1, 40))}
            if rng.random() < 0.7 else None)
    stop_ids = [rng.randrange(V + 50) for _ in range(rng.randint(0, 5))] or None
    params = SamplingParams(logit_bias=bias, stop_token_ids=stop_ids, ignore_eos=rng.random() < 0.3,
                            min_tokens=rng.choice((0, 3)), max_tokens=16)
    return SamplingRequest(params, [1, 2, 3], [5] * rng.randint(0, 5), in_reasoning=rng.random() < 0.1)


def test_same_logits_as_the_walk_on_random_batches():
    rng = random.Random(0)
    sampler = Sampler(EOS)
    for _ in range(100):
        reqs = [random_request(rng) for _ in range(rng.randint(1, 6))]
        logits = torch.randn(len(reqs), V)
        got = sampler.process_logits(logits, reqs)
        assert torch.equal(got, walked(logits, reqs))


def test_a_vocabulary_wide_bias_is_indexed_once_per_request(monkeypatch):
    """n=8 sequences of one request with a bias on every token, over several steps: the map is
    turned into tensors once, and every step's logits equal the walk's."""
    builds = []
    original = torch.tensor

    def counting_tensor(data, *args, **kwargs):
        if isinstance(data, list) and len(data) >= V:
            builds.append(len(data))
        return original(data, *args, **kwargs)

    monkeypatch.setattr(sampler_mod.torch, "tensor", counting_tensor)
    params = SamplingParams(logit_bias={t: (t % 7) - 3.0 for t in range(V)}, temperature=0.0, max_tokens=16)
    sampler = Sampler(EOS)
    for step in range(5):
        reqs = [SamplingRequest(params, [1], [3] * step) for _ in range(8)]
        logits = torch.randn(8, V)
        assert torch.equal(sampler.process_logits(logits, reqs), walked(logits, reqs))
    assert builds == [V, V]          # token ids and biases, once (into one dense row)
