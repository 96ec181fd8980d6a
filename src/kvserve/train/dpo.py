"""Direct Preference Optimization: prefer the chosen reply over the rejected one, no reward model.

For a prompt x with replies y_w (chosen) and y_l (rejected), with log-probabilities summed over
the reply tokens, of the policy π being trained and of a frozen reference copy π_ref:

    r(y)  = β · (log π(y|x) − log π_ref(y|x))          implicit reward
    loss  = −log σ( r(y_w) − r(y_l) )                   (Rafailov et al., 2023)

The reward margin r(y_w) − r(y_l) and the accuracy (margin > 0) are reported per step.
The prompt is a user message rendered through the chat template with the generation header,
and each reply is content + end-of-turn, tokenized the way SFT and serving see it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.tokenizer import Tokenizer
from kvserve.train.common import epoch_batch, frozen, init_distributed, pad_rows, token_logprobs, trainable
from kvserve.train.export import export_hf
from kvserve.train.loop import FinetuneConfig, LoopConfig, run_loop
from kvserve.train.sft import read_jsonl


@dataclass
class DPOConfig(FinetuneConfig):
    """`model`: usually the SFT output, also the frozen reference; `data`: one
    {"prompt": str | messages, "chosen": str, "rejected": str} per line; `batch_size` counts
    preference pairs."""

    lr: float = 5e-4
    warmup_steps: int = 5
    beta: float = 0.1


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss per pair, chosen reward, rejected reward) from summed reply log-probs."""
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    return -F.logsigmoid(chosen_reward - rejected_reward), chosen_reward, rejected_reward


def encode_pair(tok: Tokenizer, row: dict, max_len: int) -> tuple[list[int], list[int], int]:
    """(prompt + chosen ids, prompt + rejected ids, prompt length)."""
    prompt = row["prompt"]
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    p_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    end = tok.hf.id_to_token(tok.eos_token_id) if tok.eos_token_id is not None else ""

    def reply(text: str) -> list[int]:
        return (p_ids + tok.encode(text + end, add_special_tokens=False))[:max_len]

    return reply(row["chosen"]), reply(row["rejected"]), len(p_ids)


def reply_logprobs(model, seqs: list[list[int]], prompt_lens: list[int], pad_id: int) -> torch.Tensor:
    """Sum of log p(token) over each sequence's reply tokens: [N]."""
    ids = pad_rows(seqs, pad_id)
    logp = token_logprobs(model, ids[:, :-1], ids[:, 1:])
    pos = torch.arange(ids.shape[1] - 1)
    lens = torch.tensor([len(s) for s in seqs])
    starts = torch.tensor(prompt_lens)
    mask = (pos[None, :] >= starts[:, None] - 1) & (pos[None, :] < lens[:, None] - 1)
    return (logp * mask).sum(-1)


def dpo(cfg: DPOConfig) -> dict:
    from kvserve.model.loader import load_model

    info = init_distributed()
    torch.manual_seed(cfg.seed)
    lm = load_model(str(cfg.model), weight_format="fp32")
    tok, model = lm.tokenizer, trainable(lm.model)
    lora = bool(cfg.lora_rank or cfg.qlora)   # the reference is the base itself, scored before the adapter
    reference = frozen(model) if lora else frozen(copy.deepcopy(model))
    pairs = [encode_pair(tok, r, cfg.max_len) for r in read_jsonl(cfg.data, ("prompt", "chosen", "rejected"))]
    pad_id = tok.eos_token_id or 0
    with torch.no_grad():   # the reference never changes: score every pair once
        ref = reply_logprobs(reference, [p[0] for p in pairs] + [p[1] for p in pairs],
                             [p[2] for p in pairs] * 2, pad_id)
    ref_chosen, ref_rejected = ref[:len(pairs)], ref[len(pairs):]
    del reference
    model = trainable(model)
    if lora:
        from kvserve.train.lora import inject
        inject(model, cfg.lora_rank or 8, cfg.lora_alpha, cfg.lora_targets, cfg.qlora, seed=cfg.seed)
    per_epoch = max(1, len(pairs) // cfg.batch_size)
    total = cfg.max_steps or cfg.epochs * per_epoch
    pos = {"cursor": 0}

    def step_fn(step: int) -> dict:
        idx = epoch_batch(pos["cursor"], len(pairs), cfg.batch_size, cfg.seed, info.rank, info.world_size)
        pos["cursor"] += 1
        batch = [pairs[i] for i in idx]
        lp = reply_logprobs(model, [b[0] for b in batch] + [b[1] for b in batch], [b[2] for b in batch] * 2,
                            pad_id)
        n = len(batch)
        losses, rc, rr = dpo_loss(lp[:n], lp[n:], ref_chosen[idx], ref_rejected[idx], cfg.beta)
        loss = losses.mean()
        loss.backward()
        margin = (rc - rr).detach()
        return {"loss": loss.item(), "margin": float(margin.mean()), "acc": float((margin > 0).float().mean()),
                "chosen_reward": float(rc.detach().mean()), "rejected_reward": float(rr.detach().mean()),
                "tokens": sum(len(b[0]) + len(b[1]) for b in batch)}

    log = run_loop(model, LoopConfig.for_stage(cfg, total, "dpo"), step_fn, lambda: dict(pos), pos.update, info, cfg)
    # final reward accuracy over every pair with the trained policy
    with torch.no_grad():
        lp = reply_logprobs(model, [p[0] for p in pairs] + [p[1] for p in pairs], [p[2] for p in pairs] * 2, pad_id)
        _, rc, rr = dpo_loss(lp[:len(pairs)], lp[len(pairs):], ref_chosen, ref_rejected, cfg.beta)
    final = {"reward_accuracy": float((rc > rr).float().mean()), "reward_margin": float((rc - rr).mean())}
    if info.is_main:
        if lora:
            from kvserve.train.lora import save_adapter
            save_adapter(model, cfg.out, str(cfg.model))
        else:
            export_hf(model, cfg.model, cfg.out, tok.eos_token_ids)
    return {"out": cfg.out, "steps": total, "history": log.history, "model": model, **final}
