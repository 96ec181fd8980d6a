"""Sampler: exact distributions (chi-square against the analytic target), processor formulas,
seeds that do not depend on the batch, and raw logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.engine.sampler import Sampler, SamplingRequest, _top_p, greedy_ids, make_generator
from kvserve.sampling_params import SamplingParams

EOS = 0
N_SAMPLES = 20_000
# Distinct, well-separated logits so no top_k / top_p / min_p cutoff sits on a tie or a boundary.
LOGITS = torch.tensor([2.0, 1.3, 0.9, 0.5, 0.2, -0.1, -0.5, -0.8, -1.2, -1.9, -2.5, -3.0])


def reference_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> torch.Tensor:
    """The target distribution, written out plainly in float64 with a Python loop over tokens."""
    x = [float(v) / temperature for v in logits]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    allowed = set(order[:top_k] if top_k > 0 else order)

    def normalised(allowed: set[int]) -> dict[int, float]:
        z = sum(math.exp(x[i]) for i in allowed)
        return {i: math.exp(x[i]) / z for i in allowed}

    if top_p < 1.0:
        p = normalised(allowed)
        kept, mass = set(), 0.0
        for i in order:
            if i in allowed and mass < top_p:
                kept.add(i)
                mass += p[i]
        allowed = kept
    if min_p > 0.0:
        p = normalised(allowed)
        top = max(p.values())
        allowed = {i for i in allowed if p[i] >= min_p * top}
    p = normalised(allowed)
    return torch.tensor([p.get(i, 0.0) for i in range(len(x))], dtype=torch.float64)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    expected = probs[support] * counts.sum()
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def sample_counts(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = N_SAMPLES) -> torch.Tensor:
    reqs = [SamplingRequest(params, [1], []) for _ in range(n)]
    out = Sampler([EOS])(logits.expand(n, -1).clone(), reqs)
    return torch.bincount(out.token_ids, minlength=logits.shape[0])


@pytest.mark.parametrize("controls", [
    {"temperature": 1.0},
    {"temperature": 0.5},
    {"temperature": 1.7},
    {"top_k": 3},
    {"top_p": 0.6},
    {"top_p": 0.92},
    {"min_p": 0.15},
    {"temperature": 0.7, "top_k": 5, "top_p": 0.8},
    {"top_k": 6, "min_p": 0.3},
    {"temperature": 2.0, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 1.3, "top_k": 8, "top_p": 0.85, "min_p": 0.1},
])
def test_sampling_matches_the_analytic_distribution(controls):
    torch.manual_seed(1234)
    counts = sample_counts(SamplingParams(**controls))
    target = reference_probs(LOGITS, **controls)
    assert counts[target == 0].sum() == 0, f"tokens outside the allowed set: {counts.tolist()}"
    assert (counts[target > 0] > 0).all()
    assert chi_square_p_value(counts, target) > 0.001, (counts.tolist(), target.tolist())


def test_chi_square_detects_a_wrong_distribution():
    # The check above must be able to fail: temperature 1.0 samples against the T=0.7 target.
    torch.manual_seed(1234)
    counts = sample_counts(SamplingParams(temperature=1.0))
    assert chi_square_p_value(counts, reference_probs(LOGITS, temperature=0.7)) < 1e-6


def test_seeded_rows_follow_the_distribution_too():
    torch.manual_seed(0)
    gen = make_generator(77)
    counts = torch.zeros(LOGITS.shape[0], dtype=torch.long)
    sampler = Sampler([EOS])
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=77)
    for _ in range(4000):
        tok = sampler(LOGITS.view(1, -1), [SamplingRequest(params, [1], [], gen)]).token_ids
        counts[tok] += 1
    target = reference_probs(LOGITS, temperature=0.8, top_p=0.9)
    assert counts[target == 0].sum() == 0
    assert chi_square_p_value(counts, target) > 0.001


@pytest.mark.parametrize("scale,top_p", [(4.0, 0.9), (0.3, 0.5), (0.3, 0.97)])
def test_top_p_keeps_exactly_the_reference_set_on_a_large_vocabulary(scale, top_p):
    # scale 4 is peaked (the cutoff lies among the top candidates); 0.3 is flat, forcing a full sort.
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 2000, generator=g) * scale
    kept = _top_p(logits, [top_p] * 3) > float("-inf")
    for row in range(3):
        lp = logits[row].double().log_softmax(-1)
        probs, order = lp.exp().sort(descending=True)
        before = probs.cumsum(0) - probs
        expected = torch.zeros(2000, dtype=torch.bool)
        expected[order[before < top_p]] = True
        assert torch.equal(kept[row], expected)


def test_greedy_is_argmax_and_greedy_rows_ignore_truncation():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    reqs = [SamplingRequest(SamplingParams(temperature=0.0), [1], []) for _ in range(4)]
    assert torch.equal(Sampler([EOS])(logits, reqs).token_ids, logits.argmax(-1))
    # Mixed batch (slow path): greedy rows still take the argmax of the processed logits.
    reqs[1] = SamplingRequest(SamplingParams(temperature=0.0, top_k=2, frequency_penalty=1.0), [1], [7, 7])
    reqs[2] = SamplingRequest(SamplingParams(temperature=1.0, top_k=3), [1], [])
    out = Sampler([EOS])(logits, reqs)
    expected_row1 = logits[1].clone()
    expected_row1[7] -= 2.0
    assert out.token_ids[0] == logits[0].argmax()
    assert out.token_ids[1] == expected_row1.argmax()
    assert out.token_ids[2] in logits[2].topk(3).indices.tolist()
    assert out.token_ids[3] == logits[3].argmax()


def test_greedy_takes_the_first_of_equal_maxima_as_argmax_does():
    """greedy_ids (max(dim).indices, the faster call) picks what argmax picks: ties to the first
    maximum, a NaN row to its first NaN, an all -inf row to 0, in float32 and bfloat16."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        x = torch.randint(-3, 3, (4, 49152 if trial % 10 == 0 else 1000), generator=g).float()   # many ties
        if trial % 5 == 1:
            x[torch.rand(x.shape, generator=g) < 0.001] = float("nan")
        if trial % 7 == 2:
            x[1] = float("-inf")
        for dt in (torch.float32, torch.bfloat16):
            assert torch.equal(greedy_ids(x.to(dt)), x.to(dt).argmax(-1))
    x = torch.zeros(2, 10)
    x[0, [3, 7]] = 1.0
    assert greedy_ids(x).tolist() == [3, 0]


def test_repetition_penalty_formula():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.25, 3.0, 0.0]])
    req = SamplingRequest(SamplingParams(repetition_penalty=2.0), [1, 2], [2, 4])
    out = Sampler([EOS]).process_logits(logits, [req])
    # Seen tokens {1, 2, 4}: positive logits divided by 2, negative multiplied by 2; others untouched.
    assert torch.allclose(out, torch.tensor([[2.0, -2.0, 0.25, -0.25, 1.5, 0.0]]))


def test_presence_and_frequency_penalty_formula():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    # Prompt tokens do not count; output counts: token 1 x3, token 3 x1.
    req = SamplingRequest(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [2, 2, 2], [1, 3, 1, 1])
    out = Sampler([EOS]).process_logits(logits, [req])
    expected = torch.tensor([[1.0, 1.0 - 3 * 0.25 - 0.5, 1.0, 1.0 - 0.25 - 0.5, 1.0]])
    assert torch.allclose(out, expected)


def test_logit_bias_adds_and_ignores_ids_past_the_vocabulary():
    logits = torch.zeros(2, 6)
    reqs = [SamplingRequest(SamplingParams(logit_bias={3: 5.5, 1: -100, 99: 10}), [1], []),
            SamplingRequest(SamplingParams(), [1], [])]
    out = Sampler([EOS]).process_logits(logits, reqs)
    assert out[0].tolist() == [0.0, -100.0, 0.0, 5.5, 0.0, 0.0]
    assert out[1].tolist() == [0.0] * 6
    assert logits.eq(0).all(), "the caller's logits are not modified"
    # A +100 bias makes the token certain under sampling.
    big = SamplingRequest(SamplingParams(logit_bias={4: 100}, temperature=1.0), [1], [])
    assert Sampler([EOS])(torch.randn(1, 6), [big]).token_ids.item() == 4


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[10.0, 0.0, 9.0, 0.0, 1.0]])  # EOS (0) and stop token 2 dominate
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2])
    sampler = Sampler([EOS])
    assert sampler(logits, [SamplingRequest(params, [1], [4, 4])]).token_ids.item() == 4
    assert sampler(logits, [SamplingRequest(params, [1], [4, 4, 4])]).token_ids.item() == EOS
    processed = sampler.process_logits(logits, [SamplingRequest(params, [1], [])])
    assert processed[0, 0] == float("-inf") and processed[0, 2] == float("-inf")
    # Sampled rows, too: never EOS while masked.
    torch.manual_seed(0)
    sampled = SamplingParams(temperature=1.0, min_tokens=5)
    reqs = [SamplingRequest(sampled, [1], [3]) for _ in range(2000)]
    assert (sampler(logits.expand(2000, -1), reqs).token_ids != EOS).all()


def test_ignore_eos_masks_every_eos_always():
    logits = torch.tensor([[10.0, 0.0, 9.0, 1.0]])
    sampler = Sampler([0, 2])
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    assert sampler(logits, [SamplingRequest(params, [1], list(range(100)))]).token_ids.item() == 3


def test_greedy_rows_that_only_ban_tokens_match_the_masked_logits():
    """The greedy path without a masked copy (ignore_eos, min_tokens, reasoning: bans only) takes
    what the argmax of the processed logits takes, also when the raw maximum is banned or tied."""
    g = torch.Generator().manual_seed(1)
    sampler = Sampler([0, 2])
    kinds = [SamplingParams(temperature=0.0, ignore_eos=True), SamplingParams(temperature=0.0),
             SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[5, 7]),
             SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[5], ignore_eos=True)]
    for trial in range(60):
        x = torch.randint(-2, 3, (12, 40), generator=g).float()        # ties everywhere
        x[torch.rand(12, generator=g) < 0.5, 0] = 9.0                     # EOS often the maximum
        x[torch.rand(12, generator=g) < 0.3, 5] = 9.0                     # ... or a stop token
        reqs = [SamplingRequest(kinds[(trial + i) % 4], [1], [3] * (i % 6), in_reasoning=(trial + i) % 9 == 0)
                for i in range(12)]
        expected = sampler.process_logits(x, reqs).argmax(-1)
        assert torch.equal(sampler(x, reqs).token_ids, expected)
        assert x[:, 0].max() <= 9.0, "the caller's logits are not modified"


def test_logprobs_come_from_the_raw_distribution():
    torch.manual_seed(3)
    logits = torch.randn(3, 40)
    reqs = [SamplingRequest(SamplingParams(temperature=0.3, top_k=5, logprobs=4, repetition_penalty=1.5),
                            [1, 2, 3], [4]),
            SamplingRequest(SamplingParams(temperature=0.0, logprobs=0), [1], []),
            SamplingRequest(SamplingParams(temperature=1.0), [1], [])]
    out = Sampler([EOS])(logits, reqs)
    raw = logits.log_softmax(-1)
    for row in range(3):
        tok = out.token_ids[row]
        assert torch.isclose(out.logprobs[row], raw[row, tok])
        assert out.ranks[row] == int((raw[row] > raw[row, tok]).sum()) + 1
    assert out.ranks[1] == 1
    assert out.top_token_ids.shape == (3, 4)
    assert torch.equal(out.top_token_ids, raw.topk(4).indices)
    assert torch.allclose(out.top_logprobs, raw.topk(4).values)
    none_asked = Sampler([EOS])(logits, [SamplingRequest(SamplingParams(), [1], [])] * 3)
    assert none_asked.top_token_ids is None and none_asked.top_logprobs is None


def _run_seeded(seed: int, row: int, batch: int, steps: int = 25) -> list[int]:
    """Generate `steps` tokens for a seeded request placed at `row` among unseeded neighbours."""
    V = 8192
    sampler = Sampler([EOS])
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed)
    gen = make_generator(seed)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(top_k=10, seed=99), SamplingParams(min_p=0.1, presence_penalty=1.0)]
    tokens: list[int] = []
    logit_gen = torch.Generator().manual_seed(42)  # the "model": same logits for our row every step
    torch.manual_seed(1000 + batch)                # the neighbours' randomness differs per layout
    for _ in range(steps):
        mine = torch.randn(V, generator=logit_gen) * 3
        logits = torch.randn(batch, V) * 3
        logits[row] = mine
        reqs = [SamplingRequest(others[i % 4], [5, 6], [7], make_generator(others[i % 4].seed))
                for i in range(batch)]
        reqs[row] = SamplingRequest(params, [5, 6], list(tokens), gen)
        tokens.append(int(sampler(logits, reqs).token_ids[row]))
    return tokens


def test_seeded_request_is_identical_alone_and_in_a_batch_of_32():
    alone = _run_seeded(seed=1234, row=0, batch=1)
    in_batch = _run_seeded(seed=1234, row=17, batch=32)
    assert alone == in_batch
    assert len(set(alone)) > 1
    assert _run_seeded(seed=4321, row=0, batch=1) != alone


def test_make_generator():
    assert make_generator(None) is None
    a, b = make_generator(-5), make_generator(-5)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
