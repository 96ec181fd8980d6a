import json
import math

import torch

from kvserve.train.dpo import DPOConfig, dpo, dpo_loss


def test_loss_matches_hand_computation():
    beta = 0.5
    pc, pr = torch.tensor([-3.0, -2.0]), torch.tensor([-4.0, -1.0])
    rc, rr = torch.tensor([-3.5, -2.5]), torch.tensor([-3.0, -1.5])
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta)
    # pair 0: chosen reward 0.5*0.5 = 0.25, rejected 0.5*(-1) = -0.5, margin 0.75
    # pair 1: chosen 0.5*0.5 = 0.25, rejected 0.5*0.5 = 0.25, margin 0
    assert torch.allclose(chosen, torch.tensor([0.25, 0.25]))
    assert torch.allclose(rejected, torch.tensor([-0.5, 0.25]))
    want = torch.tensor([-math.log(1 / (1 + math.exp(-0.75))), math.log(2.0)])
    assert torch.allclose(loss, want, atol=1e-6)


def test_dpo_drives_reward_accuracy_up(base_run, tmp_path):
    words = ["apple", "river", "stone", "light", "house", "water", "bread", "night", "sword", "cloud", "field",
             "horse", "king", "gold", "tree", "fire"]
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Name a thing like {w}.", "chosen": f"A {w}, surely.",
                                        "rejected": "And the LORD said"}) + "\n" for w in words))
    r = dpo(DPOConfig(model=base_run["out"], data=str(data), out=str(tmp_path / "dpo"), beta=0.1, epochs=6,
                      batch_size=4, lr=1e-3))
    steps = [h for h in r["history"] if h["kind"] == "train"]
    assert steps[0]["acc"] == 0.0 and abs(steps[0]["margin"]) < 1e-6   # policy == reference at the start
    assert r["reward_accuracy"] > 0.9
    assert r["reward_margin"] > 0
    assert steps[-1]["loss"] < steps[0]["loss"]
