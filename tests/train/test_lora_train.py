"""LoRA / QLoRA fine-tuning on the nano base: the adapter is saved in PEFT's layout and `peft`
loads it to the same logits; `merge` folds it into the base with the same logits; QLoRA (the base
in 4 bits) lowers held-out loss about as much as LoRA on the fp32 base."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.model.loader import load_model
from kvserve.model.lora import load_adapter
from kvserve.train.lora import merge
from kvserve.train.sft import SFTConfig, encode_chat, masked_nll, sft

WORDS = "apple river stone light house water bread night sword cloud field horse king gold tree fire sheep door city wind"
TRAIN, HELD = WORDS.split()[:15], WORDS.split()[15:]


def _chat(word: str) -> dict:
    return {"messages": [{"role": "user", "content": f"Repeat: {word}"},
                         {"role": "assistant", "content": f"[[{word}]]"}]}


def _heldout_loss(model, tok) -> float:
    rows = [encode_chat(tok, _chat(w)["messages"]) for w in HELD]
    with torch.no_grad():
        return masked_nll(model, rows, tok.eos_token_id or 0)[0].item()


@pytest.fixture(scope="module")
def runs(base_run, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_sft")
    data = d / "train.jsonl"
    data.write_text("\n".join(json.dumps(_chat(w)) for w in TRAIN * 4) + "\n")
    common = {"model": base_run["out"], "data": str(data), "max_steps": 40, "batch_size": 8, "lr": 3e-3,
              "checkpoint_every": 1000, "lora_rank": 8}
    return {"lora": sft(SFTConfig(out=str(d / "lora"), **common)),
            "qlora": sft(SFTConfig(out=str(d / "qlora"), qlora=True, **common)), "base": base_run["out"], "dir": d}


def test_qlora_lowers_heldout_loss_like_lora(runs):
    lm = load_model(runs["base"], weight_format="fp32")
    before = _heldout_loss(lm.model.eval(), lm.tokenizer)
    lora = _heldout_loss(runs["lora"]["model"].eval(), lm.tokenizer)
    qlora = _heldout_loss(runs["qlora"]["model"].eval(), lm.tokenizer)
    print(f"held-out loss: base {before:.3f}, LoRA {lora:.3f}, QLoRA {qlora:.3f}")
    assert lora < before - 0.3, (before, lora)
    assert before - qlora >= 0.9 * (before - lora), (before, lora, qlora)


def test_adapter_loads_in_peft_and_merges(runs, tmp_path):
    import transformers
    from peft import PeftModel

    out = runs["lora"]["out"]
    conf = json.loads((runs["dir"] / "lora" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 8 and len(conf["target_modules"]) == 7
    ours = runs["lora"]["model"].eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref_ours = ours.compute_logits(ours(ids))
        hf = transformers.AutoModelForCausalLM.from_pretrained(runs["base"], torch_dtype=torch.float32)
        pm = PeftModel.from_pretrained(hf, out).eval()
        assert (pm(ids).logits - ref_ours).abs().max() < 1e-4
    load_adapter(out, ours.config)        # kvserve serves what it wrote
    merged = load_model(str(merge(runs["base"], out, tmp_path / "merged")), weight_format="fp32").model.eval()
    with torch.no_grad():
        assert (merged.compute_logits(merged(ids)) - ref_ours).abs().max() < 1e-4


def test_dpo_with_lora_adapter(base_run, tmp_path):
    from kvserve.train.dpo import DPOConfig, dpo

    words = ["apple", "river", "stone", "light", "house", "water", "bread", "night"]
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Name a thing like {w}.", "chosen": f"A {w}, surely.",
                                        "rejected": "And the LORD said"}) + "\n" for w in words))
    r = dpo(DPOConfig(model=base_run["out"], data=str(data), out=str(tmp_path / "dpo"), beta=0.1, max_steps=12,
                      batch_size=4, lr=5e-3, lora_rank=4, lora_targets="q,v,o"))
    steps = [h for h in r["history"] if h["kind"] == "train"]
    assert steps[0]["acc"] == 0.0 and abs(steps[0]["margin"]) < 1e-6   # B = 0: policy == reference at the start
    assert r["reward_margin"] > 0
    conf = json.loads((tmp_path / "dpo" / "adapter_config.json").read_text())
    assert conf["target_modules"] == ["o_proj", "q_proj", "v_proj"] and conf["r"] == 4
    assert not (tmp_path / "dpo" / "model.safetensors").exists()
