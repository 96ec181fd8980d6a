"""The thinking format: SFT on worked multi-step sums teaches `<think>...</think> answer` on held-out
problems, and GRPO trains on the task's verifiable reward (format and answer) outside the eval set;
the products task, its cold-start data, and (slow) GRPO teaching a model to think."""

from __future__ import annotations

import json

import pytest

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


def test_products_task_traces_and_cold_start(tmp_path):
    from kvserve.train.tasks import ThinkingProductsTask, cold_start, thought
    from kvserve.train.thinking_data import main, write_cold_start

    task = ThinkingProductsTask(max_operand=9)
    problems = task.problems()
    assert len(problems) == 10_000 and problems[1234][0].startswith("What is 1*2+3*4?")
    for q, a in problems[::37]:
        assert task.reward(task.trace(q, a), a) == 1.0
    assert task.trace(*problems[1234]) == "<think>1*2=2. 3*4=12. 2+12=14.</think> 14"
    assert task.reward("<think></think> 14", "14") == 1.0 and task.reward("<think></think> 15", "14") == 0.1
    assert thought("<think>1*2=2.</think> 2") and not thought("<think> </think> 2") and not thought("2")
    chats = cold_start(task, problems[:400], direct_fraction=0.5, seed=0)
    direct = [c for c in chats if c["messages"][1]["content"].startswith("<think></think>")]
    assert 150 < len(direct) < 250 and cold_start(task, problems[:400], 0.5, 0) == chats    # seeded
    # the written cold start leaves out exactly the problems `grpo --heldout` evaluates on
    path = write_cold_start(tmp_path / "cold.jsonl", "think-mul", 20_000, direct_fraction=0.25)
    rows = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    _, held = heldout_split(problems, 32, seed=0)
    assert len(rows) == 10_000 - 32 and not {m[0]["content"] for m in rows} & {q for q, _ in held}
    for m in rows[:50]:
        q, a = m[0]["content"], m[1]["content"].split()[-1]
        assert task.reward(m[1]["content"], a) == 1.0 and a == str(eval(q[8:q.index("?")]))
    with pytest.raises(SystemExit) as e:
        main(["--task", "think-mul", "--direct-fraction", "1.5", "--out", str(tmp_path / "x.jsonl")])
    assert e.value.code == 2 and not (tmp_path / "x.jsonl").exists()


@pytest.mark.slow
def test_grpo_teaches_a_model_to_think(base_run, tmp_path):
    """The thinking-model recipe of docs/training.md: a cold start that answers half its problems
    without working, then GRPO on held-out-free problems, lifts accuracy on 128 held-out problems by
    >= 20 points (measured over seeds 0-3: +21.4 to +28.3 points sampled, ~4 minutes of GRPO on one
    thread)."""
    from kvserve.train.thinking_data import write_cold_start

    data = write_cold_start(tmp_path / "cold.jsonl", "think-mul", 2000, direct_fraction=0.5, eval_prompts=128)
    sft(SFTConfig(model=base_run["out"], data=str(data), out=str(tmp_path / "sft"), epochs=20, batch_size=16,
                  lr=3e-3, max_len=160))
    r = grpo(GRPOConfig(model=str(tmp_path / "sft"), out=str(tmp_path / "grpo"), task="think-mul", heldout=True,
                        group_size=8, prompts_per_step=8, max_steps=600, max_tokens=64, lr=1e-4, eval_samples=8,
                        eval_prompts=128))
    lift = r["eval_accuracy_after"] - r["eval_accuracy_before"]
    assert lift >= 0.20, {k: v for k, v in r.items() if k.startswith("eval_")}
    assert r["eval_thinking_after"] > r["eval_thinking_before"] + 0.3     # by choosing to work it out
