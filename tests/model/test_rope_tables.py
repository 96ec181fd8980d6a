"""RoPE tables are the correctly rounded cos/sin of HF's float32 angles, computed without torch's
CPU cos/sin (MKL VML), whose first use in a process can race another thread's and return 11-bit
values for a whole table (issue 53: one server start in a few answered every greedy request
differently)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvserve.model.config import ModelConfig
from kvserve.model.decoder import RotaryEmbedding


@pytest.mark.parametrize("theta,positions,head_dim", [(100000.0, 8192, 64), (10000.0, 4096, 128),
                                                      (1000000.0, 32768, 80)])
def test_tables_are_correctly_rounded(theta, positions, head_dim):
    cfg = ModelConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_theta=theta,
                      max_position_embeddings=positions)
    rope = RotaryEmbedding(cfg)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rng = random.Random(0)
    for _ in range(4000):
        p, j = rng.randrange(positions), rng.randrange(head_dim)
        angle = float(torch.tensor(float(p)) * inv[j % (head_dim // 2)])   # HF's float32 product
        assert rope.cos[p, j].item() == float(torch.tensor(math.cos(angle), dtype=torch.float64).float())
        assert rope.sin[p, j].item() == float(torch.tensor(math.sin(angle), dtype=torch.float64).float())
