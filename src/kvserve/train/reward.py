"""Reward model: a scalar head on the transformer, trained on human (or synthetic) preferences.

The network is the language model being served (`DecoderLM`) with its LM head unused and
a linear head on the final hidden state of the reply's last token (its end-of-turn token):

    r(x, y) = w · h_T(x, y) + b
    loss    = −log σ( r(x, y_w) − r(x, y_l) )          Bradley-Terry (Ouyang et al., 2022)

Pairs use DPO's format ({"prompt", "chosen", "rejected"}, prompt rendered with the chat
template, reply + end-of-turn), so one preference file trains either. Every `heldout_every`-th
pair is held out; held-out pair accuracy (r_w > r_l) is logged every `eval_every` steps and at
the end. The output directory is the backbone as a normal HF model directory plus
`reward_head.safetensors` and `reward_config.json`; `load_reward_model` reads it back and
`RewardModel.score` rates (prompt, reply) pairs (GRPO's `--reward-model` uses it).

`synthetic_preferences` writes preference tasks whose better answer is checkable: "What is
a+b?" with the right sum chosen and a near miss rejected, or "Repeat the word: w" with w chosen
and another word rejected.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.errors import InvalidRequest
from kvserve.train.common import epoch_batch, init_distributed, pad_rows, trainable
from kvserve.train.dpo import encode_pair
from kvserve.train.export import export_hf
from kvserve.train.loop import LoopConfig, run_loop
from kvserve.train.sft import read_jsonl
from kvserve.train.tasks import WORDS

HEAD_FILE = "reward_head.safetensors"


class RewardModel(nn.Module):
    def __init__(self, backbone: nn.Module, tokenizer=None):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.tokenizer = tokenizer

    def forward(self, seqs: list[list[int]], pad_id: int) -> torch.Tensor:
        """One scalar per sequence, read at its last token: [N]."""
        ids = pad_rows(seqs, pad_id)
        hidden = self.backbone(ids)
        last = hidden[torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])]
        return self.head(last.float()).squeeze(-1)

    @torch.no_grad()
    def score(self, prompts: list[str], replies: list[str], batch_size: int = 32, max_len: int = 512) -> torch.Tensor:
        """r(prompt, reply) for each pair, with the chat template as in training."""
        tok = self.tokenizer
        pad = tok.eos_token_id or 0
        seqs = [encode_pair(tok, {"prompt": p, "chosen": r, "rejected": ""}, max_len)[0]
                for p, r in zip(prompts, replies)]
        return torch.cat([self(seqs[i:i + batch_size], pad) for i in range(0, len(seqs), batch_size)])


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    return -F.logsigmoid(chosen - rejected)


def load_reward_model(path: str | Path) -> RewardModel:
    from safetensors.torch import load_file

    from kvserve.model.loader import load_model

    p = Path(path)
    if not (p / HEAD_FILE).is_file():
        raise InvalidRequest(f"{p} is not a reward model directory (no {HEAD_FILE}); train one with "
                             "`kvserve train reward`", param="reward_model")
    lm = load_model(str(p), weight_format="fp32")
    rm = RewardModel(lm.model.requires_grad_(False).eval(), lm.tokenizer)
    rm.head.load_state_dict(load_file(str(p / HEAD_FILE)))
    return rm.requires_grad_(False).eval()


def synthetic_preferences(path: str | Path, task: str = "arithmetic", max_operand: int = 9,
                          wrong_per_problem: int = 4, seed: int = 0) -> Path:
    """Preference pairs whose better answer is checkable, as JSONL.

    arithmetic: "What is a+b?": chosen "The answer is {a+b}.", rejected a near miss (±1..4).
    repeat:     "Repeat the word: apple": chosen "apple", rejected another word."""
    rng = random.Random(seed)
    rows = []
    if task == "arithmetic":
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                wrong = rng.sample([a + b + d for d in (-4, -3, -2, -1, 1, 2, 3, 4) if a + b + d >= 0],
                                   min(wrong_per_problem, 4))
                rows += [{"prompt": f"What is {a}+{b}?", "chosen": f"The answer is {a + b}.",
                          "rejected": f"The answer is {w}."} for w in wrong]
    elif task == "repeat":
        for w in WORDS:
            rows += [{"prompt": f"Repeat the word: {w}", "chosen": w, "rejected": x}
                     for x in rng.sample([x for x in WORDS if x != w], wrong_per_problem)]
    else:
        raise InvalidRequest(f"unknown synthetic task {task!r}; choose arithmetic or repeat", param="task")
    rng.shuffle(rows)
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(path)


@dataclass
class RewardConfig:
    model: str                     # HF-format directory: the backbone (usually the SFT output)
    data: str                      # JSONL: {"prompt", "chosen", "rejected"}
    out: str
    epochs: int = 3
    max_steps: int | None = None
    batch_size: int = 16           # pairs per step
    lr: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_len: int = 512
    heldout_every: int = 10        # every N-th pair is held out
    eval_every: int = 25
    seed: int = 0
    checkpoint_every: int = 100
    resume: bool = False
    stop_after_steps: int | None = None


def reward(cfg: RewardConfig) -> dict:
    from kvserve.model.loader import load_model

    info = init_distributed()
    torch.manual_seed(cfg.seed)
    lm = load_model(str(cfg.model), weight_format="fp32")
    tok = lm.tokenizer
    rm = RewardModel(trainable(lm.model), tok)
    pairs = [encode_pair(tok, r, cfg.max_len) for r in read_jsonl(cfg.data, ("prompt", "chosen", "rejected"))]
    held = [p for i, p in enumerate(pairs) if i % cfg.heldout_every == cfg.heldout_every - 1]
    train = [p for i, p in enumerate(pairs) if i % cfg.heldout_every != cfg.heldout_every - 1]
    if not held or not train:
        raise InvalidRequest(f"{len(pairs)} pairs are too few to hold out every {cfg.heldout_every}-th",
                             param="data")
    pad_id = tok.eos_token_id or 0
    per_epoch = max(1, len(train) // cfg.batch_size)
    total = cfg.max_steps or cfg.epochs * per_epoch
    pos = {"cursor": 0}

    @torch.no_grad()
    def accuracy(batch: list) -> float:
        rm.eval()
        margins = torch.cat([rm([b[0] for b in batch[i:i + 64]], pad_id) - rm([b[1] for b in batch[i:i + 64]], pad_id)
                             for i in range(0, len(batch), 64)])
        rm.train()
        return float((margins > 0).float().mean())

    def step_fn(step: int) -> dict:
        idx = epoch_batch(pos["cursor"], len(train), cfg.batch_size, cfg.seed, info.rank, info.world_size)
        pos["cursor"] += 1
        batch = [train[i] for i in idx]
        r = rm([b[0] for b in batch] + [b[1] for b in batch], pad_id)
        rc, rr = r[:len(batch)], r[len(batch):]
        loss = bradley_terry_loss(rc, rr).mean()
        loss.backward()
        out = {"loss": loss.item(), "acc": float((rc > rr).float().mean()), "margin": float((rc - rr).detach().mean()),
               "tokens": sum(len(b[0]) + len(b[1]) for b in batch)}
        if (step + 1) % cfg.eval_every == 0:
            out["heldout_acc"] = accuracy(held)
        return out

    log = run_loop(rm, LoopConfig.for_stage(cfg, total, "reward"), step_fn, lambda: dict(pos), pos.update, info, cfg)
    final = {"heldout_accuracy": accuracy(held), "train_accuracy": accuracy(train[:len(held) * 4]),
             "heldout_pairs": len(held), "train_pairs": len(train)}
    if info.is_main:
        from safetensors.torch import save_file

        export_hf(rm.backbone, cfg.model, cfg.out, tok.eos_token_ids)
        save_file({k: v.detach().contiguous() for k, v in rm.head.state_dict().items()}, str(Path(cfg.out) / HEAD_FILE))
        (Path(cfg.out) / "reward_config.json").write_text(json.dumps(
            {"type": "reward_model", "head": HEAD_FILE, "loss": "bradley_terry", **final}, indent=2) + "\n")
    return {"out": cfg.out, "steps": total, "history": log.history, "model": rm, **final}
