"""Speculative decoding (issue 16) on the default model: exact, and rolled back cleanly.

- the n-gram proposer and the startup checks (unknown proposer, K outside 1..16, a draft that
  does not load or whose tokenizer differs);
- greedy with n-gram speculation == greedy without, token for token and logprob for logprob, on
  grounded and open prompts, alone and batched, with chunked prefill and prefix-cache hits, with
  stop tokens, stop strings, max_tokens and n > 1; drafts are really proposed and accepted;
- streaming yields the accepted tokens as one delta, the same text in the end;
- seeded sampled requests and requests that opt out never draft (their tokens are unchanged);
- after the runs every KV block is back in the pool, and a prompt that hits blocks cached by a
  speculating request gets the cold answer (no unverified token was ever hashed).
The sampled distribution (chi-square) is test_spec_decode_sampling.py.
"""

from __future__ import annotations

import functools
import operator

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.spec_decode.config import SpeculativeConfig
from kvserve.engine.spec_decode.proposer import NgramProposer
from kvserve.errors import InvalidRequest
from kvserve.model.loader import LoadedModel

PASSAGE = ("The river town of Lowbridge was founded in 1821 by a group of millers who needed the fast water of "
           "the Fenn to turn their wheels. Over the next century the town grew around three mills, a stone bridge "
           "and a market square, and by 1900 it had a railway station, two schools and a small hospital. The "
           "last mill closed in 1962; its building now holds the town library and a museum of milling.")
GROUNDED = [
    "Repeat the following passage exactly, word for word:\n\n" + PASSAGE,
    "Rewrite this passage in the present tense:\n\n" + PASSAGE,
    "Copy the sentences of this passage that mention a year:\n\n" + PASSAGE,
    ("Fix the spelling in this code and return it:\n\ndef add_numbres(a, b):\n    \"\"\"Add two numbres.\"\"\"\n"
    "    return a + b\n\n\ndef mul_numbres(a, b):\n    return a * b\n"),
]
OPEN = ["Name the capital city of France.", "Write a haiku about the sea.", "List three prime numbers.",
        "Why is the sky blue? Answer in two sentences."]



def make(loaded: LoadedModel, **kw) -> LLM:
    return LLM(loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory=kw.pop("kv_cache_memory", "128MiB"), **kw)


@pytest.fixture(scope="module")
def base(loaded) -> LLM:
    return make(loaded)


@pytest.fixture(scope="module")
def spec(loaded) -> LLM:
    # max_batch_rows 0: speculate in batches too, so the batched tests exercise the verification
    return make(loaded, speculative={"method": "ngram", "max_batch_rows": 0}, num_speculative_tokens=5)


def chat_ids(llm: LLM, text: str) -> dict:
    return {"prompt_token_ids": llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}],
                                                                         tokenize=True)}


def sig(out) -> list:
    return [(c.token_ids, c.text, c.finish_reason,
             [sorted((t, lp.logprob, lp.rank) for t, lp in p.items()) for p in c.logprobs or []])
            for c in out.outputs]


def drafted(llm: LLM) -> tuple[int, int]:
    s = llm.stats()
    return s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


# ---- the pieces, no model -------------------------------------------------------------------------


def test_ngram_proposer_finds_the_latest_longest_match():
    p = NgramProposer(ngram_max=3, ngram_min=1)
    assert p.lookup([1, 2, 3, 4, 5, 9, 1, 2, 3], 3) == [4, 5, 9]
    assert p.lookup([1, 2, 3, 7, 2, 3, 8, 2, 3], 2) == [8, 2]           # the latest occurrence
    assert p.lookup([5, 6, 7, 8], 4) == []                              # nothing to match
    assert p.lookup([7, 1, 2, 7], 10) == [1, 2, 7]                      # runs up to the end
    assert p.lookup([256, 1, 256], 2) == [1, 256]                       # whole tokens, not bytes
    assert p.lookup([1, 0, 0, 0, 1, 0], 1) == [0]


@pytest.mark.parametrize("spec, k, message", [
    ("medusa", None, "unknown speculative proposer"),
    ("ngram", 0, "from 1 to 16"),
    ("ngram", 17, "from 1 to 16"),
    ("draft:/nonexistent/draft.gguf", 4, "cannot load the draft model"),
    ({"method": "draft", "draft_path": "x", "draft_weight_format": "q5_0"}, None, "draft_weight_format must be one of"),
])
def test_bad_speculative_options_fail_at_startup(loaded, spec, k, message):
    with pytest.raises(InvalidRequest, match=message):
        make(loaded, speculative=spec, num_speculative_tokens=k)


def test_config_parse():
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("off") is None
    c = SpeculativeConfig.parse("draft:/m/d", 3)
    assert (c.method, c.draft_path, c.num_speculative_tokens) == ("draft", "/m/d", 3)


# ---- exactness ---------------------------------------------------------------------------------------


def test_greedy_equals_without_speculation_alone_and_batched(base, spec):
    prompts = [chat_ids(base, t) for t in GROUNDED + OPEN]
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    want = [sig(o) for o in base.generate(prompts, params, use_tqdm=False)]
    d0 = drafted(spec)
    for i, p in enumerate(prompts):                                     # alone
        assert sig(spec.generate(p, params, use_tqdm=False)[0]) == want[i], f"prompt {i} alone"
    d1 = drafted(spec)
    assert d1[1] - d0[1] > 50, f"few drafts accepted: {d0} -> {d1}"
    got = [sig(o) for o in spec.generate(prompts, params, use_tqdm=False)]   # all in one batch
    for i in range(len(prompts)):
        assert got[i] == want[i], f"prompt {i} batched"
    assert spec.engine.core.kv.num_free_blocks == spec.engine.core.kv.num_blocks


def test_greedy_with_chunked_prefill_stops_and_n(loaded, base):
    spec = make(loaded, speculative={"method": "ngram", "max_batch_rows": 0}, num_speculative_tokens=16,
                max_num_batched_tokens=32)
    prompts = [chat_ids(base, t) for t in GROUNDED[:1] + OPEN[:1]]
    tok = base.get_tokenizer()
    stop_id = tok.encode(" mill", add_special_tokens=False)[0]
    cases = [SamplingParams(temperature=0, max_tokens=23),
             SamplingParams(temperature=0, max_tokens=50, stop=["1900", "library"]),
             SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[stop_id]),
             SamplingParams(temperature=0, max_tokens=30, n=2, logprobs=0),
             SamplingParams(temperature=0, max_tokens=30, min_tokens=20, repetition_penalty=1.3)]
    for params in cases:
        want = [sig(o) for o in base.generate(prompts, params, use_tqdm=False)]
        got = [sig(o) for o in spec.generate(prompts, params, use_tqdm=False)]
        assert got == want, params
    assert drafted(spec)[1] > 0
    assert spec.engine.core.kv.num_free_blocks == spec.engine.core.kv.num_blocks


def test_prefix_cache_holds_only_verified_tokens(loaded, base):
    spec = make(loaded, speculative="ngram")
    params = SamplingParams(temperature=0, max_tokens=60)
    p = chat_ids(base, GROUNDED[0])
    first = spec.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids
    # the prompt plus the answer: its blocks were hashed while the answer was speculated
    longer = {"prompt_token_ids": p["prompt_token_ids"] + first}
    cont = SamplingParams(temperature=0, max_tokens=20, logprobs=1)
    warm = spec.generate(longer, cont, use_tqdm=False)[0]
    assert warm.num_cached_tokens >= len(longer["prompt_token_ids"]) - 2 * spec.engine.block_size
    assert sig(warm) == sig(base.generate(longer, cont, use_tqdm=False)[0])


def test_streaming_delivers_accepted_tokens_as_one_delta(base, spec):
    p = chat_ids(base, GROUNDED[0])
    params = SamplingParams(temperature=0, max_tokens=60)
    deltas = [o.outputs[0].token_ids_delta for o in spec.stream(p, params)]
    assert max(len(d) for d in deltas) > 1
    full = base.generate(p, params, use_tqdm=False)[0].outputs[0]
    assert functools.reduce(operator.iadd, deltas, []) == full.token_ids


def test_seeded_sampling_and_opt_out_do_not_draft(base, spec):
    p = chat_ids(base, GROUNDED[0])
    before = drafted(spec)
    for params in (SamplingParams(temperature=0.8, seed=7, max_tokens=30, n=2),
                   SamplingParams(temperature=0, max_tokens=30, speculative=False)):
        assert sig(spec.generate(p, params, use_tqdm=False)[0]) == sig(base.generate(p, params, use_tqdm=False)[0])
    assert drafted(spec) == before


def test_structured_output_drafts_are_checked_by_the_grammar(base, spec):
    """Under a JSON schema the drafts the grammar refuses are cut before verification, each draft
    position is masked as its own step would be, and the answer is the same as without drafts."""
    from kvserve.sampling_params import StructuredOutputsParams as SO

    schema = {"type": "object", "properties": {"town": {"type": "string"}, "founded": {"type": "integer"},
                                               "summary": {"type": "string"}},
              "required": ["town", "founded", "summary"]}
    p = chat_ids(base, "Reply in JSON with the town, the year it was founded and a summary that copies the "
                       "first sentence of this passage:\n\n" + PASSAGE)
    params = [SamplingParams(temperature=0, max_tokens=80, structured_outputs=SO(json=schema)),
              SamplingParams(temperature=0.8, max_tokens=60, structured_outputs=SO(json=schema))]
    before = drafted(spec)
    want = base.generate([p], params[:1], use_tqdm=False)[0]
    got = spec.generate([p, p], params, use_tqdm=False)
    assert sig(got[0]) == sig(want)
    assert drafted(spec)[1] > before[1]
    assert got[1].outputs[0].text.startswith("{")    # sampled under the grammar: a valid prefix
