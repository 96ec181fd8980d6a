"""A long prompt alone in the engine on a machine whose steps have a large fixed cost (a loaded
machine: issue 51's 6,000-token prompt was cut to one block a step): its chunks amortize that cost,
while a step with another request keeps the 2x rule."""

from __future__ import annotations

import numpy as np

from kvserve.engine.step_cost import StepCostModel
from tests.engine.test_fairness import make
from tests.engine.test_scheduler import BS, make_seq, new_tokens, run_step


def loaded_cost(chunks) -> float:
    """80 ms a step whatever it holds, 0.2 ms a token, 10 ns per token and position attended."""
    return 0.08 + sum(2e-4 * n + 1e-8 * n * (c + n / 2) for c, n in chunks)


def teach(s) -> None:
    for ctx, n in [(0, 256), (1000, 128), (3000, 64), (0, 16), (2000, 32), (500, 1), (4000, 256)] * 6:
        s.cost.observe([(ctx, n)], loaded_cost([(ctx, n)]))
    s.cost.flush()


def test_an_empty_step_counts_its_fixed_cost_once():
    m = StepCostModel()
    m.coef = np.array([0.06, 1e-3, 0.0, 0.0])
    assert m.max_new_tokens([], 0, 0.1205, 512) == 60        # 0.1205 - 0.06 of tokens at 1 ms
    assert m.max_new_tokens([(0, 1)], 0, 0.1205, 512) == 59    # the decode row's own token beside it


def test_a_lone_prompt_amortizes_a_large_fixed_cost_per_step():
    s = make(budget=512, threshold=256, step_ms=100, num_blocks=1100)
    teach(s)
    long = make_seq(4000, "long", base=1000)
    s.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = run_step(s)
        chunks.append(new_tokens(out)["long"])
        assert s.cost.predict([(e.num_computed_tokens, e.num_new_tokens) for e in out.scheduled]) <= 4 * 0.08 + 0.01
    assert min(chunks[2:-1]) > 8 * BS                          # not one block a step
    assert len(chunks) < 4000 / (8 * BS)


def test_beside_another_request_the_long_chunk_keeps_the_2x_rule():
    s = make(budget=512, threshold=256, step_ms=100, num_blocks=1100)
    teach(s)
    long = make_seq(4000, "long", base=1000)
    other = make_seq(300, "other", max_tokens=1, base=9000)     # long too: waits for the partial slot
    s.add(long)
    s.add(other)
    for _ in range(6):
        out = run_step(s)
        assert "long" in new_tokens(out)
        assert s.cost.predict([(e.num_computed_tokens, e.num_new_tokens) for e in out.scheduled]) <= 2 * 0.08 + 0.01
