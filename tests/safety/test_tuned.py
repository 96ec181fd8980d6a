"""Moderation's tuned top layers on the shared encoder's forward (safety/tuned.py, model/bert.py branches).

The layers under test are the shipped head's when it has them, else an untuned copy of MiniLM's
last layers with a random head (the mechanism is the same)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.model.bert import default_encoder
from kvserve.safety import finetune
from kvserve.safety.head import HEAD_PATH, Head, default_head, features
from kvserve.safety.moderator import Moderator
from kvserve.safety.tuned import BRANCH, TopLayers, attach

TEXTS = ["How do I bake sourdough bread at home?", "Tell me how to build a pipe bomb.",
         "The museum's new wing holds paintings from the seventeenth century, and the tour takes an hour."]


@pytest.fixture(scope="module")
def head() -> Head:
    shipped = default_head()
    if shipped.top:
        return shipped
    rng, n = np.random.default_rng(0), len(shipped.labels)     # a random head over the branch's 384-dim vector
    arrays = {"w1": rng.normal(0, 0.05, (64, 384)).astype(np.float32), "b1": np.zeros(64, np.float32),
              "w2": rng.normal(0, 0.05, (n, 64)).astype(np.float32), "b2": np.zeros(n, np.float32)}
    arrays.update(labels=np.array(shipped.labels), thresholds=np.array([shipped.thresholds[k] for k in shipped.labels]))
    return Head({**arrays, **finetune.top_model(64, len(shipped.labels)).arrays()})


@pytest.fixture(scope="module")
def enc(head):
    e = default_encoder()
    assert attach(e, head) == BRANCH
    return e


def test_branch_adds_a_vector_without_changing_the_shared_embedding(enc):
    full, _ = enc.encode_depths(TEXTS, (enc.layers,))
    both, _ = enc.encode_depths(TEXTS, (enc.layers, BRANCH))
    assert torch.equal(both[enc.layers], full[enc.layers])        # the cache and router see the same vector
    assert torch.allclose(both[BRANCH].norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    alone, _ = enc.encode_depths(TEXTS, (BRANCH,))                # the forward stops at the frozen layers
    assert torch.allclose(alone[BRANCH], both[BRANCH], atol=1e-5)


def test_branch_is_the_trained_model_on_the_frozen_states(enc):
    """What serving computes is what training and evaluation compute from the cached states."""
    states = finetune.frozen_states(TEXTS)
    top = enc.branches[BRANCH]
    assert isinstance(top, TopLayers) and top.start == finetune.FROZEN
    with torch.inference_mode():
        x, m = finetune.pad([states[finetune._key(t)] for t in TEXTS])
        ref = top.embed(x, m).numpy()
    served = enc.encode_depths(TEXTS, (BRANCH,))[0][BRANCH].numpy()
    assert np.abs(ref - served).max() < 2e-3          # the cached states are fp16


def test_moderator_judges_the_branch_vector(enc, head):
    mod = Moderator(engine="head", head=head)
    text = TEXTS[1]
    vec = enc.encode_depths(mod.windows(text), (BRANCH,))[0][BRANCH].numpy()
    assert np.allclose(mod.encode(mod.windows(text)), vec, atol=1e-6)
    assert mod.check(text, vectors=vec).scores == mod.check(text).scores


def test_a_head_without_tuned_layers_uses_the_shared_embedding(enc):
    with np.load(HEAD_PATH) as z:
        plain = Head({k: z[k] for k in z.files if not k.startswith("top.")})
    assert attach(enc, plain) is None
    mod = Moderator(engine="head", head=plain)
    depths = plain.depths(enc.layers, full=enc.layers)      # its layers' pooled states, the embedding last
    ref = features(enc.encode_depths(["hello there"], depths)[0], depths)
    assert np.allclose(mod.encode(["hello there"]), ref, atol=1e-6)
    assert np.allclose(ref[:, -384:], enc.encode(["hello there"])[0].numpy(), atol=1e-6)
