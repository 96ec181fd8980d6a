"""bench/footprint.py: bytes per decode token of the default model, and the table."""

from __future__ import annotations

import torch

from kvserve.bench.footprint import Footprint, footprint_table, kv_bytes_per_token, weight_bytes_per_token
from kvserve.model.loader import load_model


def test_bytes_per_token_of_the_default_model():
    lm = load_model(None)
    size = lm.source.path.stat().st_size
    w = weight_bytes_per_token(lm.model)      # tied head: the whole table once, as the LM head
    assert 0.8 * size < w < 1.1 * size, (w, size)
    c = lm.config
    assert kv_bytes_per_token(c, 10, torch.float16) == c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2 * 10
    row = {"engine": "kvserve", **Footprint(1.0, {"VmRSS": 2**30}, size, w, 0, 10e9).row(50.0)}
    assert abs(row["roofline_share"] - 50.0 / (10e9 / w)) < 1e-9
    assert "| kvserve | 1.00 | 1024 (0) |" in footprint_table([row])
