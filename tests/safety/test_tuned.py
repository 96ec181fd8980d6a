"""Moderation's tuned top layers on the shared encoder's forward (safety/tuned.py, model/bert.py branches)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.model.bert import default_encoder
from kvserve.safety import finetune
from kvserve.safety.head import default_head
from kvserve.safety.moderator import Moderator
from kvserve.safety.tuned import BRANCH, TopLayers, attach

TEXTS = ["How do I bake sourdough bread at home?", "Tell me how to build a pipe bomb.",
         "The museum's new wing holds paintings from the seventeenth century, and the tour takes an hour."]


@pytest.fixture(scope="module")
def branch_encoder():
    enc = default_encoder()
    head = default_head()
    if not head.top:
        pytest.skip("the shipped head has no tuned layers")
    assert attach(enc, head) == BRANCH
    return enc


def test_branch_adds_a_vector_without_changing_the_shared_embedding(branch_encoder):
    enc = branch_encoder
    full, _ = enc.encode_depths(TEXTS, (enc.layers,))
    both, _ = enc.encode_depths(TEXTS, (enc.layers, BRANCH))
    assert torch.equal(both[enc.layers], full[enc.layers])        # the cache and router see the same vector
    assert torch.allclose(both[BRANCH].norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    assert (both[BRANCH] * both[enc.layers]).sum(1).max() < 0.999  # the tuned layers do change it
    alone, _ = enc.encode_depths(TEXTS, (BRANCH,))                # the forward stops at the frozen layers
    assert torch.allclose(alone[BRANCH], both[BRANCH], atol=1e-5)


def test_branch_is_the_trained_model_on_the_frozen_states(branch_encoder):
    """What serving computes is what training and evaluation compute from the cached states."""
    enc = branch_encoder
    states = finetune.frozen_states(TEXTS)
    top = enc.branches[BRANCH]
    assert isinstance(top, TopLayers) and top.start == finetune.FROZEN
    with torch.inference_mode():
        x, m = finetune.pad([states[finetune._key(t)] for t in TEXTS])
        ref = top.embed(x, m).numpy()
    served = enc.encode_depths(TEXTS, (BRANCH,))[0][BRANCH].numpy()
    assert np.abs(ref - served).max() < 2e-3          # the cached states are fp16


def test_moderator_judges_the_branch_vector(branch_encoder):
    mod = Moderator(engine="head")
    text = TEXTS[1]
    vec = branch_encoder.encode_depths(mod.windows(text), (BRANCH,))[0][BRANCH].numpy()
    assert np.allclose(mod.encode(mod.windows(text)), vec, atol=1e-6)
    assert mod.check(text, vectors=vec).blocking
