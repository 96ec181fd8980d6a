"""Supervised fine-tuning on chats: learn to answer, charged only for the assistant's tokens.

A conversation is rendered with the model's own chat template exactly as the server renders a
prompt, and tokenized piece by piece at the same boundaries the server sees: the prompt up to
and including the generation header (`<|im_start|>assistant\\n`) is encoded as one prompt is,
and the reply (content + end-of-turn token) is encoded on its own, as the model would produce
it token by token. Loss mask (1 = trained):

    <|im_start|>user\\nWhat is 2+2?<|im_end|>\\n<|im_start|>assistant\\n  4<|im_end|>  \\n ...
    0 ..........................................................0    1 .......1   0

so the model learns what to say and when to stop, never to predict the user's words.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.errors import InvalidRequest
from kvserve.tokenizer import Tokenizer
from kvserve.train.common import init_distributed, pad_rows, token_logprobs, trainable
from kvserve.train.export import export_hf
from kvserve.train.loop import FinetuneConfig, LoopConfig, run_loop


@dataclass
class SFTConfig(FinetuneConfig):
    """`model`: e.g. the output of `kvserve train pretrain`; `data`: one
    {"messages": [{"role": ..., "content": ...}, ...]} per line."""

    debug: bool = False            # print the first example with its trained tokens marked


def read_jsonl(path: str | Path, required: tuple[str, ...]) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise InvalidRequest(f"data file {p} does not exist", param="data")
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"{p}:{n} is not valid JSON ({e})", param="data") from None
        missing = [k for k in required if k not in row]
        if missing:
            raise InvalidRequest(f"{p}:{n} lacks {', '.join(missing)}; each line needs {', '.join(required)}",
                                 param="data")
        rows.append(row)
    if not rows:
        raise InvalidRequest(f"{p} has no examples", param="data")
    return rows


def encode_chat(tok: Tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and a 0/1 mask marking assistant-reply tokens."""
    end = tok.hf.id_to_token(tok.eos_token_id) if tok.eos_token_id is not None else None
    ids: list[int] = []
    mask: list[int] = []
    done = ""   # text already encoded

    def add(text: str, trained: int) -> None:
        new = tok.encode(text, add_special_tokens=False) if text else []
        ids.extend(new)
        mask.extend([trained] * len(new))

    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        prompt = tok.apply_chat_template(messages[:i], add_generation_prompt=True)
        full = tok.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise InvalidRequest("the chat template does not render conversations as growing prefixes; "
                                 "SFT cannot locate the assistant turns", param="messages")
        add(prompt[len(done):], 0)
        reply = full[len(prompt):]
        cut = reply.find(end) + len(end) if end and end in reply else len(reply)
        add(reply[:cut], 1)
        done = prompt + reply[:cut]
    if not any(mask):
        raise InvalidRequest("conversation has no assistant message to learn from", param="messages")
    full = tok.apply_chat_template(messages, add_generation_prompt=False)
    add(full[len(done):], 0)
    return ids, mask


def format_mask(tok: Tokenizer, ids: list[int], mask: list[int]) -> str:
    """The conversation as text with trained spans in «guillemets» (the debug print)."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        text = tok.decode(ids[i:j], skip_special_tokens=False)
        out.append(f"«{text}»" if mask[i] else text)
        i = j
    return "".join(out)


def masked_nll(model, rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, int]:
    """Mean negative log-likelihood over masked (assistant) target tokens, and their count."""
    ids = pad_rows([r[0] for r in rows], pad_id)
    mask = pad_rows([r[1] for r in rows], 0)
    logp = token_logprobs(model, ids[:, :-1], ids[:, 1:])
    m = mask[:, 1:].float()
    return -(logp * m).sum() / m.sum().clamp(min=1), int(m.sum())


def sft(cfg: SFTConfig) -> dict:
    from kvserve.model.loader import load_model

    info = init_distributed()
    torch.manual_seed(cfg.seed)
    lm = load_model(str(cfg.model), weight_format="fp32")
    tok, model = lm.tokenizer, trainable(lm.model)
    if cfg.lora_rank or cfg.qlora:
        from kvserve.train.lora import inject
        inject(model, cfg.lora_rank or 8, cfg.lora_alpha, cfg.lora_targets, cfg.qlora, seed=cfg.seed)
    examples = []
    for row in read_jsonl(cfg.data, ("messages",)):
        ids, mask = encode_chat(tok, row["messages"])
        examples.append((ids[:cfg.max_len], mask[:cfg.max_len]))
    if cfg.debug and info.is_main:
        print(f"[sft] example 0, {sum(examples[0][1])} of {len(examples[0][0])} tokens trained (in «»):")
        print(format_mask(tok, *examples[0]))
    per_epoch = max(1, len(examples) // cfg.batch_size)
    total = cfg.max_steps or cfg.epochs * per_epoch
    pad_id = tok.eos_token_id or 0
    pos = {"cursor": 0}

    def batch_at(cursor: int) -> list[tuple[list[int], list[int]]]:
        # a fresh shuffle per epoch, derived from (seed, epoch): the cursor alone is the data state
        epoch, k = divmod(cursor, per_epoch)
        order = list(range(len(examples)))
        random.Random(cfg.seed * 1000003 + epoch).shuffle(order)
        chosen = order[k * cfg.batch_size:(k + 1) * cfg.batch_size]
        share = len(chosen) // info.world_size
        return [examples[i] for i in chosen[info.rank * share:(info.rank + 1) * share]]

    def step_fn(step: int) -> dict:
        rows = batch_at(pos["cursor"])
        pos["cursor"] += 1
        loss, n = masked_nll(model, rows, pad_id)
        loss.backward()
        return {"loss": loss.item(), "tokens": sum(len(r[0]) for r in rows), "trained_tokens": n}

    log = run_loop(model, LoopConfig.for_stage(cfg, total, "sft"), step_fn, lambda: dict(pos), pos.update, info, cfg)
    if info.is_main and getattr(model, "lora_train", None):
        from kvserve.train.lora import save_adapter
        save_adapter(model, cfg.out, str(cfg.model))
    elif info.is_main:
        export_hf(model, cfg.model, cfg.out, tok.eos_token_ids)
    return {"out": cfg.out, "steps": total, "history": log.history, "model": model, "tokenizer": tok}
