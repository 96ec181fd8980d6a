"""`kvserve train cache-head`: a short run moves paraphrases together (and not everything), the
file it writes loads as the cache's head, and its data stays disjoint from the benchmark pairs."""

from __future__ import annotations

import numpy as np

from kvserve.bench import semantic_pairs
from kvserve.train.cache_head import PARAPHRASES, paraphrase_groups, save_head, train_cache_head


def test_training_data_is_disjoint_from_the_benchmark():
    # entities are disjoint; number pairs may repeat, under other operations (-, /, ^ vs +, *)
    bench_values = {v for _, values, _ in semantic_pairs.INTENTS for v in values if isinstance(v, str)}
    ours = {v for _, values, _ in PARAPHRASES for v in values if isinstance(v, str)}
    assert bench_values and ours and not bench_values & ours
    assert not {i for i, _, _ in semantic_pairs.INTENTS} & {i for i, _, _ in PARAPHRASES}
    assert len(paraphrase_groups()) > 500


def test_short_training_pulls_paraphrases_together(tmp_path):
    from kvserve.model.bert import default_encoder
    from kvserve.semantic_text import normalize
    from kvserve.server.routing.semantic_cache import load_head

    arrays = train_cache_head(hidden=64, steps=60, batch=256, seed=0, members=1)
    path = tmp_path / "h.npz"
    digest = save_head(arrays, path, hidden=64)
    head = load_head(str(path))
    assert head.digest == digest and head.w1.shape == (64, 384)
    enc = default_encoder()
    groups = paraphrase_groups()[::40]
    same = []
    for _, _, qs in groups:
        v, _ = enc.encode([normalize(q) for q in qs[:2]])
        same.append(v.float().numpy())
    raw = np.stack(same)                       # [groups, 2, dim]
    z = head.project(raw)
    def pos_neg(v):
        pos = np.einsum("gd,gd->g", v[:, 0], v[:, 1])
        neg = (v[:, 0] @ v[:, 0].T)[~np.eye(len(v), dtype=bool)]    # other questions
        return pos, neg
    raw_pos, _ = pos_neg(raw)
    z_pos, z_neg = pos_neg(z)
    assert z_pos.mean() > raw_pos.mean() + 0.01                   # paraphrases closer
    assert (z_pos >= 0.95).mean() > (raw_pos >= 0.95).mean()      # more of them over the threshold
    assert (z_neg >= 0.95).mean() <= 0.01 and z_neg.max() < z_pos.max()   # not everything


def test_cli_refuses_an_unwritable_out_before_training(tmp_path):
    from typer.testing import CliRunner

    from kvserve.train.cli import train_app

    r = CliRunner().invoke(train_app, ["cache-head", "--out", str(tmp_path / "missing" / "h.npz")])
    assert r.exit_code != 0 and "does not exist" in r.output
