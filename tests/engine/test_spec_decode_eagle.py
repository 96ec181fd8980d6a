"""EAGLE-style drafts (issue 16, spec_decode/eagle.py): a head over the target's own features.

- `kvserve train draft --kind eagle` labels every answer position with the target's argmax;
- a trained head loads as the proposer and speculation stays exact, alone and batched, after a
  prefix-cache hit, over a bounded catch-up window, after a long pause, with features bounded;
- the features a request keeps by position (newest row wins, trimmed when consumed);
- EAGLE-3-style inner layers: captured by the target's forward, read by the head, checked at startup;
- the draft step as one C call gives the pieces' tokens and states bit for bit;
- bad heads: a wrong fc shape or bad inner layers are one-line startup errors.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_spec_decode import chat_ids, sig
from test_spec_decode_draft import PROMPTS, check_identical, make

from kvserve import SamplingParams
from kvserve.engine.spec_decode.proposer import HiddenSink
from kvserve.errors import InvalidRequest
from kvserve.train.draft import DraftConfig, train_draft

# ---- EAGLE: a draft head over the target's features (spec_decode/eagle.py) ----------------------

@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle")
    r = train_draft(DraftConfig(out=str(out), kind="eagle", num_prompts=6, gen_tokens=12, steps=3, batch_size=2,
                                vocab_size=512, heldout=2, quiet=True))
    assert r["kind"] == "eagle" and r["steps"] == 3
    return out


def test_eagle_training_labels_are_the_target_argmax(loaded, tmp_path):
    """An EAGLE head learns the target's top token at each answer position (what greedy verification
    accepts), not a sampled answer's own token: greedy answers are their own labels, sampled ones
    get the argmax of the target's logits from the very features the head reads."""
    from kvserve.train.draft import _generate

    cfg = DraftConfig(out=str(tmp_path), kind="eagle", num_prompts=4, heldout=1, gen_tokens=32, greedy_share=0.5,
                      temperature=1.0)
    prompts = ["Tell me about the moon.", "Write a haiku about tea.", "Tell me about owls.", "Describe a picnic."]
    seqs, starts, feats, best = _generate(loaded, prompts, cfg, features=True)
    H = loaded.model.config.hidden_size
    assert best[0] == seqs[0] and best[1] == seqs[1]                         # greedy
    for s, b, f, p in zip(seqs[2:], best[2:], feats[2:], starts[2:]):
        assert len(b) == len(s) and b[:p] == s[:p] and b[p:] != s[p:]        # sampled: labels differ
        top = loaded.model.compute_logits(f[p - 1:, :H].float()).argmax(-1).tolist()
        same = sum(x == y for x, y in zip(top, b[p:]))
        assert same >= 0.9 * len(top)                                        # fp16 features: near ties may flip


def test_trained_eagle_draft_is_exact(loaded, eagle_dir):
    from kvserve.engine.spec_decode.eagle import EAGLE_FILE, EagleProposer

    assert (eagle_dir / EAGLE_FILE).is_file()
    assert json.loads((eagle_dir / "config.json").read_text())["num_hidden_layers"] == 1
    base = make(loaded)
    spec = make(loaded, speculative={"method": "draft", "draft_path": str(eagle_dir), "max_batch_rows": 0},
                num_speculative_tokens=3)
    proposer = spec.engine.core.scheduler.spec.proposer
    assert isinstance(proposer, EagleProposer)
    assert spec.engine.core.runner.hidden_sink is proposer.hidden_sink
    assert proposer.hidden_sink.observe == proposer.observe_hidden and proposer.hidden_sink.layers == ()
    check_identical(base, spec)
    st = spec.stats()
    assert st["spec_decode_num_draft_tokens"] > 0          # the features reached the draft
    assert not proposer.caches and not proposer.features   # forgotten with their requests


def test_eagle_after_a_prefix_cache_hit(loaded, eagle_dir):
    """The second run of a prompt computes only its uncached tail: the draft's cache starts there."""
    base = make(loaded)
    spec = make(loaded, speculative={"method": "draft", "draft_path": str(eagle_dir), "max_batch_rows": 0},
                num_speculative_tokens=3, enable_prefix_caching=True)
    p = chat_ids(base, PROMPTS[2] + " " + "Answer in detail, step by step, please." * 4)
    params = SamplingParams(temperature=0, max_tokens=20)
    want = sig(base.generate(p, params, use_tqdm=False)[0])
    assert sig(spec.generate(p, params, use_tqdm=False)[0]) == want
    d0 = spec.stats()["spec_decode_num_draft_tokens"]
    assert sig(spec.generate(p, params, use_tqdm=False)[0]) == want
    assert spec.stats()["spec_decode_num_draft_tokens"] > d0
    assert spec.stats()["prefix_cache_hits"] > 0


def test_eagle_catches_up_over_a_bounded_window(loaded, eagle_dir, monkeypatch):
    """A request's first draft after a long prompt runs the draft over the newest positions only
    (the draft's cache starts there), and speculation stays exact."""
    from kvserve.engine.spec_decode import eagle

    monkeypatch.setattr(eagle, "_MAX_CATCHUP", 8)
    base = make(loaded)
    spec = make(loaded, speculative={"method": "draft", "draft_path": str(eagle_dir), "max_batch_rows": 0},
                num_speculative_tokens=3)
    draft = spec.engine.core.scheduler.spec.proposer.draft
    rows, step = [], draft._step
    monkeypatch.setattr(draft, "_step", lambda items: (rows.append(max(len(t) for *_, t in items)), step(items))[1])
    p = chat_ids(base, PROMPTS[2] + " " + "Answer in detail, step by step, please." * 4)
    params = SamplingParams(temperature=0, max_tokens=20)
    assert sig(spec.generate(p, params, use_tqdm=False)[0]) == sig(base.generate(p, params, use_tqdm=False)[0])
    assert len(p["prompt_token_ids"]) > 40 and rows and max(rows) <= 9


def test_eagle_starts_over_after_a_long_pause(loaded, eagle_dir, monkeypatch):
    """A request whose draft fell further behind than _MAX_CATCHUP (it did not draft for a while)
    restarts its draft cache near the newest position instead of running every position it missed."""
    import torch

    from kvserve.engine.spec_decode import eagle

    spec = make(loaded, speculative={"method": "draft", "draft_path": str(eagle_dir), "max_batch_rows": 0})
    draft = spec.engine.core.scheduler.spec.proposer.draft
    rows, step = [], draft._step
    monkeypatch.setattr(draft, "_step", lambda items: (rows.append(max(len(t) for *_, t in items)), step(items))[1])
    feats = eagle._Features(loaded.model.config.hidden_size)
    feats.put(0, torch.randn(300, loaded.model.config.hidden_size))      # the target's rows, positions 0..299
    cache, seq = draft.new_cache(), list(range(100, 401))
    for L in (100, 101, 301):                    # a first draft, the next step's, then one 200 steps later
        assert len(draft.propose_batch([(cache, feats, seq[:L], 1)])[0]) == 1
    assert rows[0] == eagle._MAX_CATCHUP and rows[1] <= 2 and rows[2] == eagle._MAX_CATCHUP
    assert cache.origin == 300 - eagle._MAX_CATCHUP
    draft.pool.release(cache)


def test_eagle_features_by_position():
    import torch

    from kvserve.engine.spec_decode.eagle import _Features

    f = _Features(2)
    f.put(5, torch.tensor([[5.0, 0], [6, 0], [7, 0]]))        # first computed position: 5
    assert f.origin == 5 and f.end == 8 and f.get(4, 6) is None and f.get(6, 9) is None
    f.put(7, torch.tensor([[70.0, 0], [8, 0]]))               # a rejected draft's row, then overwritten
    assert f.get(5, 9)[:, 0].tolist() == [5, 6, 70, 8]
    f.put(7, torch.tensor([[7.0, 0]]))
    assert f.get(7, 9)[:, 0].tolist() == [7, 8]
    for i in range(9, 200):
        f.put(i, torch.tensor([[float(i), 0]]))
    f.trim(150)                                               # consumed: dropped
    assert f.origin > 5 and f.get(150, 200)[:, 0].tolist() == list(range(150, 200))
    assert f.get(149, 151) is None and len(f.chunks) == 50
    f.put(200, torch.tensor([[200.0, 1], [201, 1], [202, 1]]))   # inside the newest step's rows
    assert f.get(201, 203).tolist() == [[201, 1], [202, 1]] and f.get(199, 201)[:, 0].tolist() == [199, 200]

    # a step's rows by reference: this request's rows 1..2 of the step, final [T, 2] and inner [T, 2, 2]
    g = _Features(6)
    step = torch.arange(8.0).view(4, 2)
    inner = 100 + torch.arange(16.0).view(4, 2, 2)
    g.put(10, step, inner, row=1, n=2)
    assert g.get(10, 12).tolist() == [[2, 3, 104, 105, 106, 107], [4, 5, 108, 109, 110, 111]]
    assert g.get(10, 12).dtype == torch.float32


def test_bad_eagle_head_fails_at_startup(loaded, eagle_dir, tmp_path):
    import torch
    from safetensors.torch import save_file

    from kvserve.engine.spec_decode.eagle import EAGLE_FILE

    bad = tmp_path / "bad"
    shutil.copytree(eagle_dir, bad)
    save_file({"fc.weight": torch.zeros(8, 8)}, str(bad / EAGLE_FILE))
    with pytest.raises(InvalidRequest, match="fc must be"):
        make(loaded, speculative=f"draft:{bad}")


def test_eagle_features_are_bounded_and_the_draft_starts_over(loaded, eagle_dir, monkeypatch):
    """A request that keeps more rows than the bound loses the oldest; its draft cache then restarts
    at the first row kept (and speculation stays exact)."""
    from kvserve.engine.spec_decode import eagle

    monkeypatch.setattr(eagle, "_MAX_FEATURE_ROWS", 16)
    base = make(loaded)
    spec = make(loaded, speculative={"method": "draft", "draft_path": str(eagle_dir), "max_batch_rows": 0},
                num_speculative_tokens=3)
    check_identical(base, spec, max_tokens=40, batched=False, n=1)
    assert spec.stats()["spec_decode_num_draft_tokens"] > 0


# ---- EAGLE-3-style features: inner layers beside the final one ----------------------------------

@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle3")
    r = train_draft(DraftConfig(out=str(out), kind="eagle", feature_layers="2,14", num_prompts=6, gen_tokens=12,
                                steps=3, batch_size=2, vocab_size=512, heldout=2, quiet=True))
    assert r["feature_layers"] == [2, 14]
    return out


def test_eagle_with_inner_layers_is_exact(loaded, eagle3_dir):
    from kvserve.engine.spec_decode.eagle import EAGLE_CONFIG

    assert json.loads((eagle3_dir / EAGLE_CONFIG).read_text()) == {"feature_layers": [2, 14]}
    base = make(loaded)
    spec = make(loaded, speculative={"method": "draft", "draft_path": str(eagle3_dir), "max_batch_rows": 0},
                num_speculative_tokens=3)
    proposer = spec.engine.core.scheduler.spec.proposer
    assert proposer.draft.num_inner == 2 and proposer.hidden_sink.layers == (2, 14)
    assert spec.engine.core.runner.hidden_sink is proposer.hidden_sink
    seen = []
    observe = proposer.observe_hidden
    spec.engine.core.runner.hidden_sink = HiddenSink(
        lambda s, h, c: (seen.append(h.shape[-1] + c.shape[1] * c.shape[2]), observe(s, h, c)), (2, 14))
    check_identical(base, spec)
    H = loaded.model.config.hidden_size
    assert set(seen) == {3 * H}                            # the final row and two inner layers' each step
    assert spec.stats()["spec_decode_num_draft_tokens"] > 0


def test_eagle_with_q4_1_weights_is_exact(loaded, eagle3_dir):
    """draft_weight_format="q4_1": the head's layer, fc and kept head rows are packed into Q4_1 blocks
    (fewer bytes to read a draft step); verification keeps the output the target's."""
    import gguf

    base = make(loaded)
    spec = make(loaded, speculative={"method": "draft", "draft_path": str(eagle3_dir), "max_batch_rows": 0,
                                     "draft_weight_format": "q4_1"}, num_speculative_tokens=3)
    draft = spec.engine.core.scheduler.spec.proposer.draft
    layer = draft.model.layers[0]
    for lin in (draft.fc, draft.head, layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        assert lin.qtype == gguf.GGMLQuantizationType.Q4_1
    check_identical(base, spec)
    assert spec.stats()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("layers", [[2, 2], [99], "2"])
def test_bad_inner_layers_fail_at_startup(loaded, eagle3_dir, tmp_path, layers):
    from kvserve.engine.spec_decode.eagle import EAGLE_CONFIG

    bad = tmp_path / "bad"
    shutil.copytree(eagle3_dir, bad)
    (bad / EAGLE_CONFIG).write_text(json.dumps({"feature_layers": layers}))
    with pytest.raises(InvalidRequest, match="feature_layers"):
        make(loaded, speculative=f"draft:{bad}")


def _record(draft) -> tuple[list, list]:
    """Wrap a draft's step: (every step's tokens and state rows, whether each step took the one call)."""
    seen, calls = [], []
    step, one = draft._step, draft._fused_step

    def fused_step(*args):
        r = one(*args)
        calls.append(r is not None)
        return r

    def recorded(items):
        toks, h = step(items)
        seen.append((toks, h.clone()))
        return toks, h

    draft._fused_step, draft._step = fused_step, recorded
    return seen, calls


def test_eagle_step_in_one_call_matches_the_model_path(loaded, eagle3_dir):
    """The draft step as one C call (fc, the layer, the head and argmax: CpuOps.draft_step) proposes
    the same tokens from the same states, bit for bit, as the model forward between the packed fc
    and head, over the same steps (catch-up rows, later draft positions, several requests)."""
    import torch

    runs = []
    for fused in (True, False):
        spec = make(loaded, speculative={"method": "draft", "draft_path": str(eagle3_dir), "max_batch_rows": 0},
                    num_speculative_tokens=3)
        draft = spec.engine.core.scheduler.spec.proposer.draft
        if fused and getattr(draft.model.layer_ops(), "draft_step", None) is None:
            pytest.skip("no C kernels on this machine: the draft runs on PyTorch")
        draft.fused = fused
        seen, calls = _record(draft)
        prompts = [chat_ids(spec, t) for t in PROMPTS]
        spec.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        runs.append(seen)
        assert calls == ([True] * len(seen) if fused else [])      # every step took the one call
    fused, ref = runs
    assert len(fused) == len(ref) > 3
    for (ta, ha), (tb, hb) in zip(fused, ref):
        assert ta == tb and torch.equal(ha, hb)


def test_common_prefix_of_a_draft_cache_and_its_sequence():
    import random

    from kvserve.engine.spec_decode.draft import _common_prefix

    rng = random.Random(0)
    for _ in range(2000):
        seq = [rng.randrange(5) for _ in range(rng.randrange(1, 120))]
        off = rng.randrange(len(seq))
        a = seq[off:] + [rng.randrange(5) for _ in range(rng.randrange(4))]
        if a and rng.random() < 0.7:           # a mismatch somewhere: near the end mostly, anywhere at times
            i = len(a) - 1 - rng.randrange(min(len(a), 6)) if rng.random() < 0.8 else rng.randrange(len(a))
            a[i] = 9
        limit = rng.randrange(min(len(a), len(seq) - off) + 1)
        want = 0
        while want < limit and a[want] == seq[off + want]:
            want += 1
        assert _common_prefix(a, seq, off, limit) == want


def test_chained_training_steps_are_the_served_steps():
    """`--eagle-steps`: EagleHead.chain runs every draft step from every position in one masked pass,
    and gives what serving computes one step at a time: step 1 is the plain head, and step s at row j
    is the head run over the true inputs to position j followed by its own chained inputs (output of
    step s-1, position j's inner layers, the next token) at positions j+1.., causally."""
    import torch

    from kvserve.model.loader import load_model
    from kvserve.train.draft import _draft_model
    from kvserve.train.draft_eagle import EagleHead

    torch.manual_seed(0)
    fp32 = load_model(None, weight_format="fp32")
    H = fp32.config.hidden_size
    head = EagleHead(_draft_model(fp32.model, [fp32.config.num_hidden_layers - 1]), H, num_inner=1).eval()
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.05)             # every part of the input counts
        T = 12
        feats = torch.randn(2, T, 2 * H)
        ids = torch.randint(0, 1000, (2, T + 2))
        one = head.chain(feats, ids, 1)
        three = head.chain(feats, ids, 3)
        torch.testing.assert_close(one[0], head(feats, ids[:, :T]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(three[0], one[0], atol=1e-4, rtol=1e-4)
        body, emb = head.body, head.body.embed_tokens
        x1 = head.fc(torch.cat([feats, emb[ids[:, :T]]], -1))
        for j in (0, 5, T - 1):
            xs, out = [x1[:, :j + 1]], one[0][:, j:j + 1]
            for s in (1, 2):                        # steps 2 and 3, one at a time as served
                xs.append(head.fc(torch.cat([out, feats[:, j:j + 1, H:], emb[ids[:, j + s:j + s + 1]]], -1)))
                x = torch.cat(xs, 1)
                out = body(ids[:, :x.shape[1]], inputs_embeds=x)[:, -1:]
                torch.testing.assert_close(three[s][:, j:j + 1], out, atol=1e-4, rtol=1e-4)


def test_continue_training_a_saved_head(loaded, eagle_dir, eagle3_dir, tmp_path):
    """`--init DIR` continues from a saved head (its vocabulary and feature layers) and reports the
    chained second step's agreement; a directory without a head, another head's feature layers, and
    the options on a non-EAGLE draft are one-line errors."""
    from kvserve.engine.spec_decode.eagle import EAGLE_CONFIG

    out = tmp_path / "more"
    r = train_draft(DraftConfig(out=str(out), kind="eagle", init=str(eagle3_dir), num_prompts=6, gen_tokens=12,
                                steps=2, batch_size=2, heldout=2, quiet=True, seed=3))
    assert r["init"] == str(eagle3_dir) and 0 <= r["heldout_step2_agreement"] <= 1
    assert (json.loads((out / "draft_vocab.json").read_text())
            == json.loads((eagle3_dir / "draft_vocab.json").read_text()))
    assert (json.loads((out / EAGLE_CONFIG).read_text())
            == json.loads((eagle3_dir / EAGLE_CONFIG).read_text()))
    for bad, message in (({"init": str(tmp_path)}, "cannot continue from"),
                         ({"init": str(eagle3_dir), "feature_layers": "1,2"}, "reads feature layers"),
                         ({"init": str(eagle_dir), "kind": "layers"}, "init is for --kind eagle"),
                         ({"eagle_steps": 5}, "eagle_steps must be 1 to 4")):
        with pytest.raises(InvalidRequest, match=message):
            train_draft(DraftConfig(**{"out": str(tmp_path / "x"), "kind": "eagle", "num_prompts": 4,
                                       "gen_tokens": 4, "steps": 1, "heldout": 1, "quiet": True, **bad}))
