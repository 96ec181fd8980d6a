"""`kvserve train router`: the classifier trained on the built-in labelled prompts separates easy
from hard on held-out prompts; bad label files are a clear error; the router picks models by level."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvserve.errors import InvalidRequest
from kvserve.train.router_training import labelled_prompts, read_labelled, train_router


@pytest.fixture(scope="module")
def clf():
    return train_router(labelled_prompts())


def test_trained_classifier_generalizes(clf):
    assert clf["examples"] >= 200 and clf["heldout_accuracy"] >= 0.9
    # hand-written prompts in none of the templates' shapes (train/router_training.py HELD_OUT)
    assert clf["layers"] == 2 and clf["handwritten_accuracy"] >= 0.9
    json.dumps(clf)   # plain JSON, no pickle


def test_classifier_layers_checked(tmp_path):
    from kvserve.server.routing.embedder import Embedder
    from kvserve.server.routing.model_router import ModelRouter

    with pytest.raises(InvalidRequest, match="layers"):
        train_router(labelled_prompts()[:40], layers=7)
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"classes": [0, 1], "coef": [[0.0] * 384], "intercept": [0.0], "layers": "two"}))

    class Pool:
        def names(self):
            return ["a"]
    with pytest.raises(InvalidRequest, match="layers"):
        ModelRouter.from_config({"classifier": str(path)}, Pool(), None)
    path.write_text(json.dumps({"classes": [0, 1], "coef": [[0.0] * 384], "intercept": [0.0], "layers": 9}))
    with pytest.raises(InvalidRequest, match="encoder has 6"):   # at load, not at the first request
        ModelRouter.from_config({"classifier": str(path)}, Pool(), Embedder())
    path.write_text(json.dumps({"classes": [0, 1], "coef": [[0.0] * 384], "intercept": [0.0]}))
    assert ModelRouter.from_config({"classifier": str(path)}, Pool(), None).depth is None   # older files: full embedding


def test_router_predicts_levels_of_unseen_prompts(clf):
    from kvserve.model.bert import default_encoder
    from kvserve.server.routing.model_router import ModelRouter

    r = ModelRouter("auto", pool=None, embedder=None, classifier=clf, levels=None)
    enc = default_encoder()
    easy = ["Hello there!", "What is the capital of Peru?", "What is 3 + 4?"]
    hard = ["Write a B-tree in Rust with unit tests and explain the design.",
            "Explain the causes and consequences of the Industrial Revolution in detail, step by step."]
    vecs, _ = enc.encode_depths(easy + hard, (r.depth,))
    levels = [r.predict(v.numpy())[0] for v in vecs[r.depth]]
    assert levels == [0] * len(easy) + [1] * len(hard)
    _level, probs = r.predict(np.zeros(384, dtype=np.float32))
    assert len(probs) == 2 and abs(sum(probs) - 1) < 1e-6


def test_read_labelled(tmp_path):
    good = tmp_path / "ok.jsonl"
    good.write_text('{"prompt": "hi", "label": "easy"}\n\n{"prompt": "prove it", "label": 1}\n')
    assert read_labelled(good) == [("hi", 0), ("prove it", 1)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n')
    with pytest.raises(InvalidRequest, match="bad.jsonl:1"):
        read_labelled(bad)
    one = tmp_path / "one.jsonl"
    one.write_text('{"prompt": "hi", "label": 0}\n')
    with pytest.raises(InvalidRequest, match="two labels"):
        read_labelled(one)
