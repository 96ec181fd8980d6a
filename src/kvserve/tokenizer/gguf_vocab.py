"""HF `tokenizers` pipelines rebuilt from a GGUF file's `tokenizer.ggml.*` fields, as llama.cpp reads them.

- `gpt2` (byte-level BPE): vocabulary and merges, the pre-tokenizer llama.cpp names in
  `tokenizer.ggml.pre` (`PRE_TOKENIZERS`), the byte-level decoder.
- `llama` (SentencePiece; Llama 2, Mistral, Mixtral, Phi-3, TinyLlama, Gemma 1-3): llama.cpp's
  `llm_tokenizer_spm` prefixes a space when `add_space_prefix` (default true; Gemma's files say
  false) at the start and after every special token, turns ' ' into U+2581 and nothing else (no
  NFKC, no whitespace folding), then repeatedly merges the adjacent pair whose concatenation is
  the highest-scoring vocabulary entry (ties: the leftmost), and spells any piece that is not a
  token as its `<0xXX>` byte tokens. That is a BPE whose merges are every split of every token
  into two tokens, ranked by the merged token's score: what we build (as transformers'
  GGUFLlamaConverter does), with byte fallback. The decoder maps U+2581 back to ' ', joins the
  byte pieces into UTF-8 and drops the prefixed space.

Control, user-defined and unknown tokens become added tokens, matched whole in text (control
and unknown ones are `special`: skipped when decoding with skip_special_tokens). Phi-3's files
strip whitespace after special tokens, as llama.cpp does for a model named phi-3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from kvserve.errors import ModelLoadError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"

_GPT2 = "gpt2"
_DIGITS = "digits"
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> the split llama.cpp's llm_tokenizer_bpe applies (llama-vocab.cpp): GPT-2's
# regex; single digits, then GPT-2's regex; Llama 3's regex; Qwen2's (single digits). Others
# (deepseek, falcon, gpt-4o, ... and llama.cpp's "default", whose extra splits we do not apply)
# get GPT-2's regex: none of the families in docs/models.md uses them.
PRE_TOKENIZERS: dict[str, str] = {
    **dict.fromkeys(("gpt2", "default", "mpt", "olmo", "jais", "trillion", "granite-docling"), _GPT2),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
                    _DIGITS),
    **dict.fromkeys(("llama3", "llama-bpe", "llama-v3", "dbrx", "smaug-bpe", "chatglm-bpe", "falcon3",
                     "pixtral"), _LLAMA3_RE),
    **dict.fromkeys(("qwen2", "stablelm2", "hunyuan", "megrez"), _QWEN2_RE),
}


def _pre_tokenizer(pre: str | None):
    kind = PRE_TOKENIZERS.get(pre or "default", _GPT2)   # unknown names: GPT-2's regex
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == _GPT2:
        return byte_level
    if kind == _DIGITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(kind), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


Field = Callable[..., Any]


def _added_tokens(tokens: list[str], types: list[int], *, rstrip: bool = False) -> list[AddedToken]:
    out = []
    for t, ty in zip(tokens, types, strict=True):
        if ty in (CONTROL, USER_DEFINED, UNKNOWN):
            strip = rstrip and t not in ("<unk>", "<s>", "<|endoftext|>")
            out.append(AddedToken(t, special=ty != USER_DEFINED, normalized=False, rstrip=strip))
        elif rstrip and t == "</s>":
            out.append(AddedToken(t, special=True, normalized=False, rstrip=True))
    return out


def bpe_from_gguf(field: Field) -> HFTokenizer:
    """The byte-level BPE (`gpt2`): vocabulary, merges, pre-tokenizer, special tokens."""
    tokens = field("tokenizer.ggml.tokens")
    types = list(field("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    hf = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = _pre_tokenizer(field("tokenizer.ggml.pre"))
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, ty in enumerate(types) if ty in (CONTROL, USER_DEFINED)])
    return hf


def spm_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, the highest-scoring merged token first."""
    ranked = []
    for tok, tid in vocab.items():
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in vocab and right in vocab:
                ranked.append((-scores[tid], tid, -k, left, right))
    ranked.sort()
    return [(r[3], r[4]) for r in ranked]


def spm_from_gguf(field: Field) -> HFTokenizer:
    """llama.cpp's SentencePiece tokenizer (`llama`) as a byte-fallback BPE (see the module doc)."""
    tokens = list(field("tokenizer.ggml.tokens"))
    n = len(tokens)
    scores = [float(s) for s in (field("tokenizer.ggml.scores") or [0.0] * n)]
    types = list(field("tokenizer.ggml.token_type") or [NORMAL] * n)
    if len(scores) != n or len(types) != n:
        raise ModelLoadError("GGUF tokenizer.ggml.scores / token_type do not match tokenizer.ggml.tokens in "
                             "length: the file's vocabulary is corrupt; re-convert it with llama.cpp")
    add_prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab[t] = i          # a repeated text means its last id, as llama.cpp's token_to_id
    byte_fallback = any(ty == BYTE for ty in types)
    hf = HFTokenizer(models.BPE(vocab, spm_merges(vocab, scores), fuse_unk=False, byte_fallback=byte_fallback))
    norms = [normalizers.Prepend(SPACE)] if add_prefix else []
    hf.normalizer = normalizers.Sequence([*norms, normalizers.Replace(" ", SPACE)])
    decs = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        decs.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(decs)
    name = str(field("general.name", "") or "").lower()
    added = _added_tokens(tokens, types, rstrip="phi-3" in name or "phi3" in name)
    hf.add_special_tokens([a for a in added if a.special])
    hf.add_tokens([a for a in added if not a.special])     # user-defined: matched, not skipped
    return hf


def exact_spm_encoder(field: Field):
    """llama.cpp's SPM encoder step for step (spm_exact.py) where the BPE cannot be exact (equal
    scores), else None."""
    from kvserve.tokenizer.spm_exact import SpmEncoder, needs_exact

    if field("tokenizer.ggml.model") != "llama" or field("tokenizer.ggml.scores") is None:
        return None
    tokens = list(field("tokenizer.ggml.tokens"))
    scores = list(field("tokenizer.ggml.scores"))
    types = list(field("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if not needs_exact(tokens, scores, types):
        return None
    name = str(field("general.name", "") or "").lower()
    rstrip = [a.content for a in _added_tokens(tokens, types, rstrip="phi-3" in name or "phi3" in name) if a.rstrip]
    return SpmEncoder(tokens, scores, types, add_space_prefix=bool(field("tokenizer.ggml.add_space_prefix", True)),
                      rstrip=rstrip)


def hf_from_gguf(field: Field) -> HFTokenizer:
    """The tokenizer of the file's `tokenizer.ggml.model` (`gpt2` or `llama`)."""
    kind = field("tokenizer.ggml.model")
    if kind == "gpt2":
        return bpe_from_gguf(field)
    if kind == "llama":
        return spm_from_gguf(field)
    raise ModelLoadError(f"unsupported GGUF tokenizer model {kind!r}: kvserve reads SentencePiece ('llama') "
                         "and byte-level BPE ('gpt2') tokenizers from GGUF; use the model's tokenizer.json")
