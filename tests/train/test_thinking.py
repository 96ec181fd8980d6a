"""A thinking model: SFT teaches the <think>...</think> format on multi-step sums, then GRPO with the
verifiable reward raises accuracy on held-out problems. Slow (about 20 minutes on two busy cores)."""

from __future__ import annotations

import json

import pytest

from kvserve.train.grpo import GRPOConfig, grpo
from kvserve.train.sft import SFTConfig, sft
from kvserve.train.tasks import ThinkingArithmeticTask, heldout_split


@pytest.mark.slow
def test_grpo_lifts_held_out_accuracy_of_a_thinking_model(base_run, tmp_path):
    task = ThinkingArithmeticTask(max_operand=4, terms=3)
    train, held = heldout_split(task.problems(), 32, seed=0)
    data = tmp_path / "think.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": task.trace(q, a)}]}) + "\n"
                            for q, a in train))
    sft(SFTConfig(model=base_run["out"], data=str(data), out=str(tmp_path / "sft"), epochs=50, batch_size=16,
                  lr=3e-3))
    r = grpo(GRPOConfig(model=str(tmp_path / "sft"), out=str(tmp_path / "grpo"), task="think", max_operand=4,
                        terms=3, heldout=True, group_size=8, prompts_per_step=8, max_steps=1200, max_tokens=48,
                        lr=3e-4, eval_samples=8, eval_prompts=32))
    held_problems = {q for q, _ in held}
    assert held_problems.isdisjoint(q for q, _ in train)
    before, after = r["eval_accuracy_before"], r["eval_accuracy_after"]
    assert after >= before + 0.20, (before, after)
