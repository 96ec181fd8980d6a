"""Byte-level BPE tokenizer training with HF `tokenizers`, written as a model directory's files.

Byte-level BPE (GPT-2 style) starts from the 256 byte symbols, so any string, emoji included,
encodes and decodes back exactly; merges are learnt from the corpus until `vocab_size`. The chat
control tokens are added as *special* tokens: matched whole in text, never split or merged, and
the ChatML template below (the same one kvserve applies at serving time) frames the turns.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvserve.errors import InvalidRequest
from kvserve.tokenizer import Tokenizer
from kvserve.tokenizer.chat_template import DEFAULT_CHAT_TEMPLATE

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]      # ids 0, 1, 2
CHATML_TEMPLATE = DEFAULT_CHAT_TEMPLATE


def train_tokenizer(texts: list[str], vocab_size: int = 4096, min_frequency: int = 2) -> HFTokenizer:
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise InvalidRequest(f"vocab size {vocab_size} is too small: byte-level BPE needs at least "
                             f"{256 + len(SPECIAL_TOKENS) + 1} (256 bytes + special tokens + 1 merge)",
                             param="vocab_size")
    tok = HFTokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok: HFTokenizer, out_dir: str | Path) -> Path:
    """tokenizer.json + tokenizer_config.json (ChatML template, eos <|im_end|>, pad <|endoftext|>)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": EOT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": 2048,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, "special": True} for t in SPECIAL_TOKENS},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def load_tokenizer(path: str | Path) -> Tokenizer:
    p = Path(path)
    if not (p / "tokenizer.json").is_file():
        raise InvalidRequest(f"{p} has no tokenizer.json: train one with `kvserve train tokenizer --out {p}`",
                             param="tokenizer")
    return Tokenizer.from_dir(p)


def special_id(tokenizer: Tokenizer, token: str) -> int:
    tid = tokenizer.hf.token_to_id(token)
    if tid is None:
        raise InvalidRequest(f"tokenizer has no {token} token; train it with `kvserve train tokenizer`",
                             param="tokenizer")
    return tid


def bytes_per_token(tokenizer: Tokenizer | HFTokenizer, text: str) -> float:
    """Compression: UTF-8 bytes of `text` per token (higher = fewer tokens for the same text)."""
    hf = tokenizer.hf if isinstance(tokenizer, Tokenizer) else tokenizer
    n = len(hf.encode(text, add_special_tokens=False).ids)
    return len(text.encode("utf-8")) / max(n, 1)
