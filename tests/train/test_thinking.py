"""The <think> arithmetic dataset (train/thinking_data.py), and (slow) a model SFT'd on it that
thinks before it answers: its chat answers split into reasoning and content, and a reasoning
budget cuts its thinking short."""

from __future__ import annotations

import json
import random
import re

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.loader import load_model
from kvserve.server.stages.reasoning import ReasoningParser
from kvserve.train.sft import SFTConfig, sft
from kvserve.train.thinking_data import make_dataset, problem, write_jsonl


def test_problems_are_worked_and_right():
    rng = random.Random(0)
    for _ in range(300):
        q, steps, ans = problem(rng)
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", q).groups()
        assert ans == eval(f"{a}{op}{b}") and steps[-1] == f"So {a} {op} {b} = {ans}."
        for s in steps[:-1]:                        # every step's own arithmetic is right
            lhs, rhs = s.split(" = ")
            assert eval(lhs) == int(rhs.split(",")[0].rstrip(".")), s
    reply = make_dataset(1, seed=3)[0]["messages"][1]["content"]
    p = ReasoningParser()
    r, c = p.feed(reply)
    r2, c2 = p.finish()
    assert (c + c2).isdigit() and "think>" not in r + r2


@pytest.mark.slow
def test_sft_makes_a_model_that_thinks(base_run, tmp_path):
    data = write_jsonl(tmp_path / "think.jsonl", 400, seed=0, max_operand=20)
    sft(SFTConfig(model=base_run["out"], data=str(data), out=str(tmp_path / "sft"), epochs=4, batch_size=16,
                  lr=3e-3, max_len=160))
    lm = load_model(str(tmp_path / "sft"), weight_format="fp32")
    llm = LLM(lm.model, tokenizer=lm.tokenizer, kv_cache_memory="32MiB")
    convs = [[{"role": "user", "content": problem(random.Random(1000 + i), 20)[0]}] for i in range(8)]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=120), use_tqdm=False)
    split = []
    for o in outs:
        p = ReasoningParser()
        r, c = p.feed(o.outputs[0].text)
        r2, c2 = p.finish()
        split.append((r + r2, (c + c2).strip()))
    thought = [r for r, c in split if r and c]
    assert len(thought) >= 6, json.dumps(split)           # it thinks, then answers
    # a budget of 4 tokens: the engine closes the block and the model answers after it
    tok = lm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(c) + "<think>\n", add_special_tokens=False) for c in convs]
    cut = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, reasoning_budget=4), use_tqdm=False)
    for o in cut:
        before, sep, _ = o.outputs[0].text.partition("</think>")
        assert sep and len(tok.encode(before, add_special_tokens=False)) <= 6, o.outputs[0].text
