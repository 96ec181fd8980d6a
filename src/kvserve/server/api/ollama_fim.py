"""Fill in the middle for Ollama's `/api/generate` `suffix`: the prompt is the code before the
cursor, `suffix` the code after it, and the answer the code between.

The model's own FIM tokens frame them, prefix-suffix-middle, as code models are trained:

    <fim_prefix>{prompt}<fim_suffix>{suffix}<fim_middle>      (StarCoder, StableCode, Granite)
    <|fim_prefix|>{prompt}<|fim_suffix|>{suffix}<|fim_middle|> (Qwen2.5-Coder, CodeGemma)
    <｜fim▁begin｜>{prompt}<｜fim▁hole｜>{suffix}<｜fim▁end｜>   (DeepSeek-Coder)

The frame is built as token ids and runs as a completions request on them (moderated as the
text they decode to): no chat template, no system prompt, no reasoning. A model whose vocabulary has none of these triples cannot fill in the middle: the
request is a 400 that says so (Ollama's "does not support insert"), and `/api/show` lists
"insert" among a model's capabilities only when it can.
"""

from __future__ import annotations

from typing import Any

from kvserve.errors import InvalidRequest

FIM_TRIPLES = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


def fim_tokens(tokenizer: Any) -> tuple[int, int, int] | None:
    """(prefix, suffix, middle) token ids of the first FIM triple the vocabulary holds whole."""
    for triple in FIM_TRIPLES:
        ids = [tokenizer.hf.token_to_id(t) for t in triple]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]
    return None


def fim_prompt(tokenizer: Any, model: str, prefix: str, suffix: str) -> list[int]:
    """The token ids of the fill-in-the-middle prompt; a 400 when the model has no FIM tokens."""
    ids = fim_tokens(tokenizer)
    if ids is None:
        raise InvalidRequest(f"{model} does not support insert: its vocabulary has no fill-in-the-middle tokens "
                             "(<fim_prefix>, <fim_suffix>, <fim_middle> or the like). Send the prompt without "
                             "suffix, or use a code model trained to fill in the middle.", param="suffix")
    pre, suf, mid = ids
    head = [tokenizer.bos_token_id] if tokenizer.add_bos and tokenizer.bos_token_id is not None else []
    return (head + [pre] + tokenizer.encode(prefix, add_special_tokens=False)
            + [suf] + tokenizer.encode(suffix, add_special_tokens=False) + [mid])
