"""Prompt lookup first, the draft model where it finds nothing (`--speculative ngram+draft:PATH`,
spec_decode/decoder.py): lookup drafts skip the model, keep rates of their own and leave the model's
rate and pauses alone; greedy output stays the target's own."""

from __future__ import annotations

import pytest
from test_spec_decode import chat_ids, sig
from test_spec_decode_draft import _ListProposer, make
from test_spec_decode_eagle import eagle_dir  # noqa: F401  (a fixture: a tiny trained EAGLE head)

from kvserve import SamplingParams
from kvserve.engine.request import Request
from kvserve.engine.spec_decode import decoder
from kvserve.engine.spec_decode.config import SpeculativeConfig
from kvserve.engine.spec_decode.decoder import SpecDecoder
from kvserve.errors import InvalidRequest


def test_config():
    c = SpeculativeConfig.parse("ngram+draft:/some/dir", 3)
    assert (c.method, c.draft_path, c.lookup_first, c.lookup_min, c.num_speculative_tokens) == (
        "draft", "/some/dir", True, 2, 3)
    assert not SpeculativeConfig.parse("draft:/some/dir").lookup_first
    with pytest.raises(InvalidRequest, match="lookup_first goes with a draft model"):
        SpeculativeConfig("ngram", lookup_first=True)
    with pytest.raises(InvalidRequest, match="lookup_min"):
        SpeculativeConfig("draft", draft_path="x", lookup_first=True, lookup_min=0)
    with pytest.raises(InvalidRequest, match="ngram\\+draft:PATH"):
        SpeculativeConfig.parse("ngram+dreft:x")


def _req(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(temperature=0, max_tokens=100), 0, max_tokens=100)


def test_lookup_drafts_skip_the_model_and_keep_their_own_rates():
    model = _ListProposer()
    sd = SpecDecoder(SpeculativeConfig("draft", draft_path="x", lookup_first=True, num_speculative_tokens=4), model)
    rep = _req("rep", [5, 6, 8, 9, 10, 11, 1, 5, 6])     # ends with 5 6, seen before: lookup finds 8 9 10 11
    one = _req("one", [5, 6, 8, 9, 10, 11, 1, 2, 6])     # only its last token repeats: below lookup_min
    new = _req("new", list(range(20, 40)))
    drafts = sd.propose([rep, one, new])
    assert drafts == [[8, 9, 10, 11], [7] * 4, [7] * 4]
    assert model.asked == [[4, 4]]                       # the model ran for the other two only
    model_rate = sd.state["one"].rate
    sd.observe("rep", 4, 1)
    sd.observe("one", 4, 0)
    assert "rep" not in sd.state                         # a lookup round is not the model's
    assert sd.lookup_rate[0] > 0.8 and sd.lookup_rate[1] < 0.8 and sd.lookup_rate[2] == 0.8
    assert sd.pos_rate[0] < 0.6 and sd.state["one"].rate < model_rate
    st = sd.stats()
    assert (st["spec_decode_num_drafts"], st["spec_decode_num_lookup_drafts"]) == (2, 1)
    assert st["spec_decode_num_draft_tokens"] == 8 and st["spec_decode_num_accepted_tokens"] == 1
    sd.state["one"].pause = 5                            # a paused request still gets lookup's drafts
    one.output_token_ids = [8]                           # ... 6 8 now repeats: lookup finds 9 10 11 1
    assert sd.propose([one]) == [[9, 10, 11, 1]] and sd.state["one"].pause == 4
    assert model.asked == [[4, 4]]


def test_lookup_positions_stop_where_they_stop_paying():
    from kvserve.engine.step_cost import StepCostModel

    sd = SpecDecoder(SpeculativeConfig("draft", draft_path="x", lookup_first=True, num_speculative_tokens=4),
                     _ListProposer())
    cost = StepCostModel()
    rep = _req("rep", [5, 6, 8, 9, 10, 11, 1, 5, 6])
    bar = sd.break_even([rep.num_tokens], cost, proposer_s=0.0)[0]
    sd.lookup_rate = [0.9, 0.9, bar / 0.81 * 0.9, 0.9]  # P(1..3 accepted) falls just under the bar
    assert sd.propose([rep], cost) == [[8, 9]]
    sd.lookup_rate = [bar / 2] * 4                       # after a run of rejected lookups: off, but probed
    got = [sd.propose([rep], cost)[0] for _ in range(3 * decoder._COOLDOWN_COLD)]
    assert [d for d in got if d[:1] == [8]] == [[8]] * 3      # the rest are the model's
    sd.observe("rep", 1, 1)                              # a probe accepted: its rate recovers
    assert sd.lookup_rate[0] > bar / 2


PASSAGE = ("The old mill stood by the river for two hundred years. The old mill ground wheat for the village, "
           "and the village grew around the old mill.")


def test_lookup_then_draft_is_exact(loaded, eagle_dir):  # noqa: F811
    base = make(loaded)
    spec = make(loaded, speculative=f"ngram+draft:{eagle_dir}", num_speculative_tokens=3)
    sd = spec.engine.core.scheduler.spec
    sd.config.max_batch_rows = 0                         # no cost gate: every position drafts
    prompts = [chat_ids(base, t) for t in (f"Repeat this passage twice: {PASSAGE}", "Write a haiku about the sea.",
                                           f"Copy the passage word for word. {PASSAGE}")]
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    want = [sig(o) for o in base.generate(prompts, params, use_tqdm=False)]
    for i, p in enumerate(prompts):
        assert sig(spec.generate(p, params, use_tqdm=False)[0]) == want[i], f"prompt {i} alone"
    assert [sig(o) for o in spec.generate(prompts, params, use_tqdm=False)] == want, "batched"
    st = spec.stats()
    lookups = st["spec_decode_num_lookup_drafts"]
    assert lookups > 0 and st["spec_decode_num_drafts"] > lookups     # both kinds of draft were verified
    kv = spec.engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks
