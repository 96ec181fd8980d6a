"""The thinking format: SFT on worked multi-step sums teaches `<think>...</think> answer` on held-out
problems, and GRPO trains on the task's verifiable reward (format and answer) outside the eval set."""

from __future__ import annotations

import json

from kvserve import LLM, SamplingParams
from kvserve.train.grpo import GRPOConfig, grpo
from kvserve.train.sft import SFTConfig, sft
from kvserve.train.tasks import ThinkingArithmeticTask, heldout_split


def test_sft_teaches_the_thinking_format_and_grpo_trains_on_it(base_run, tmp_path):
    task = ThinkingArithmeticTask(max_operand=4, terms=3)
    train, held = heldout_split(task.problems(), 32, seed=0)
    assert not set(held) & set(train)
    data = tmp_path / "think.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": task.trace(q, a)}]}) + "\n"
                            for q, a in train))
    sft(SFTConfig(model=base_run["out"], data=str(data), out=str(tmp_path / "sft"), epochs=50, batch_size=16,
                  lr=3e-3))
    llm = LLM(str(tmp_path / "sft"), weight_format="fp32", kv_cache_memory="32MiB")
    outs = llm.chat([[{"role": "user", "content": q}] for q, _ in held], SamplingParams(temperature=0, max_tokens=48),
                    use_tqdm=False)
    rewards = [task.reward(o.outputs[0].text, a) for o, (_, a) in zip(outs, held)]
    assert sum(r > 0 for r in rewards) >= 0.9 * len(held), [o.outputs[0].text for o in outs][:4]   # the format

    r = grpo(GRPOConfig(model=str(tmp_path / "sft"), out=str(tmp_path / "grpo"), task="think", max_operand=4,
                        terms=3, heldout=True, group_size=4, prompts_per_step=4, max_steps=5, max_tokens=48,
                        lr=3e-4, eval_samples=2, eval_prompts=32))
    steps = [h for h in r["history"] if h["kind"] == "train"]
    assert len(steps) == 5 and all(0 <= h["accuracy"] <= 1 for h in steps)
    assert r["eval_task_reward_before"] >= 0.1 * 0.9       # nearly every held-out reply is in the format
    assert (tmp_path / "grpo" / "curves.png").is_file()
