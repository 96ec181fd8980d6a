import json

import torch

from kvserve.train.grpo import ArithmeticTask, GRPOConfig, group_advantages, grpo
from kvserve.train.sft import SFTConfig, sft


def test_reward_is_an_exact_check():
    assert ArithmeticTask.reward("7", "7") == 1.0
    assert ArithmeticTask.reward(" 7 apples", "7") == 1.0
    assert ArithmeticTask.reward("17", "7") == 0.0
    assert ArithmeticTask.reward("seven", "7") == 0.0


def test_advantages_are_relative_to_the_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert torch.equal(group_advantages(r, scale=False), torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4]))
    scaled = group_advantages(r, scale=True)
    assert torch.allclose(scaled[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (r[0].std() + 1e-4))
    assert torch.equal(scaled[1], torch.zeros(4))       # a group that all agree teaches nothing


def test_grpo_raises_mean_reward(base_run, tmp_path):
    task = ArithmeticTask(max_operand=2)
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in task.problems()))
    # an SFT teaches the answer format; GRPO then has to find the right numbers. Margins measured:
    # 20 SFT epochs and 30 steps gave +0.049 on an AMD EPYC (+0.05 needed), 20 and 50 gave +0.108
    # there and +0.049 on a Sapphire Rapids (AMX); 40 and 60 give +0.236 on the latter (+0.205 with
    # the AVX2 ISA forced), 40 and 40 still +0.115.
    sft(SFTConfig(model=base_run["out"], data=str(data), out=str(tmp_path / "sft"), epochs=40, batch_size=9,
                  lr=3e-3))
    r = grpo(GRPOConfig(model=str(tmp_path / "sft"), out=str(tmp_path / "grpo"), max_operand=2, group_size=8,
                        prompts_per_step=4, max_steps=60, max_tokens=4, lr=1e-3, eval_samples=32, kl_coef=0.01))
    rewards = [h["reward"] for h in r["history"] if h["kind"] == "train"]
    assert len(rewards) == 60 and all("kl" in h for h in r["history"] if h["kind"] == "train")
    assert r["eval_reward_after"] > r["eval_reward_before"] + 0.05, (r["eval_reward_before"], r["eval_reward_after"])


def test_thinking_task_checks_format_and_answer():
    from kvserve.train.tasks import ThinkingArithmeticTask, heldout_split

    task = ThinkingArithmeticTask(max_operand=9, terms=3)
    problems = task.problems()
    assert len(problems) == 1000 and problems[123][0].startswith("What is 1+2+3?")
    q, a = problems[123]
    assert a == "6" and task.trace(q, a) == "<think>1+2=3. 3+3=6.</think> 6"
    assert task.reward(task.trace(q, a), a) == 1.0
    assert task.reward("<think>1+2=3. 3+3=7.</think> 7", a) == 0.1       # format right, answer wrong
    assert task.reward("6", a) == 0.0                                     # answer right, no thinking
    assert task.reward("<think>6</think>", a) == 0.1
    assert task.reward("<think>x</think> 6 <think>y</think>", a) == 0.0
    train, held = heldout_split(problems, 32, seed=0)
    assert len(held) == 32 and not set(held) & set(train) and len(train) == 968
