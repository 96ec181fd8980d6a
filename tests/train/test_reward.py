import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.train.grpo import GRPOConfig, grpo
from kvserve.train.reward import (
    RewardConfig,
    bradley_terry_loss,
    load_reward_model,
    reward,
    synthetic_preferences,
)
from kvserve.train.sft import SFTConfig, sft
from kvserve.train.tasks import RepeatTask


def test_bradley_terry_loss_by_hand():
    loss = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0]))
    assert torch.allclose(loss, torch.tensor([math.log(1 + math.exp(-1.0)), math.log(2.0)]))


@pytest.fixture(scope="module")
def reward_run(base_run, tmp_path_factory):
    # "Repeat the word: w": w is right, any other word wrong. (The arithmetic task, "What is a+b?" with
    # a near miss rejected, stays at chance for the 0.36M-parameter nano model within this budget.)
    d = tmp_path_factory.mktemp("reward")
    data = synthetic_preferences(d / "prefs.jsonl", task="repeat", wrong_per_problem=12, seed=0)
    return data, reward(RewardConfig(model=base_run["out"], data=str(data), out=str(d / "rm"), epochs=10,
                                     batch_size=16, lr=5e-3, eval_every=50))


def test_reward_model_learns_a_checkable_preference(reward_run):
    data, r = reward_run
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == 360 and all(r["chosen"] != r["rejected"] for r in rows)
    assert r["heldout_pairs"] == 36
    assert r["heldout_accuracy"] >= 0.85, r["heldout_accuracy"]   # 32 of 36 (0.889) since RoPE's correctly rounded tables
    steps = [h for h in r["history"] if h["kind"] == "train"]
    assert steps[0]["acc"] == 0.0 and steps[0]["margin"] == 0.0        # the zero-initialised head ties at first
    # the saved directory scores pairs the same way
    rm = load_reward_model(r["out"])
    s = rm.score(["Repeat the word: stone", "Repeat the word: stone"], ["stone", "bread"])
    assert s[0] > s[1]
    assert (Path(r["out"]) / "loss_curve.png").is_file()
    assert json.loads((Path(r["out"]) / "reward_config.json").read_text())["heldout_accuracy"] == r["heldout_accuracy"]


def test_grpo_scored_by_the_reward_model_with_kl(base_run, reward_run, tmp_path):
    """RLHF: the policy's reward is the reward model's score, with a KL penalty to the SFT model."""
    _, rm = reward_run
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in RepeatTask().problems()))
    sft(SFTConfig(model=base_run["out"], data=str(data), out=str(tmp_path / "sft"), epochs=3, batch_size=10,
                  lr=3e-3))
    r = grpo(GRPOConfig(model=str(tmp_path / "sft"), out=str(tmp_path / "rlhf"), task="repeat",
                        reward_model=rm["out"], group_size=8, prompts_per_step=4, max_steps=40, max_tokens=4,
                        lr=1e-3, eval_samples=8, kl_coef=0.05))
    steps = [h for h in r["history"] if h["kind"] == "train"]
    assert len(steps) == 40 and all("kl" in h and "task_reward" in h for h in steps)
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)        # the policy starts as the reference
    assert r["eval_reward_after"] > r["eval_reward_before"] + 0.5, (r["eval_reward_before"], r["eval_reward_after"])
    assert (tmp_path / "rlhf" / "curves.png").is_file() and (tmp_path / "rlhf" / "config.json").is_file()


def test_reward_cli_rejects_a_missing_file(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvserve.cli", "train", "reward", "--model", str(tmp_path),
                        "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "error:" in r.stderr and "Traceback" not in r.stderr
