"""Held-out evaluation: loss, perplexity and bits per byte, and the unigram baseline to beat.

Loss per token depends on the tokenizer (a bigger vocabulary has fewer, harder tokens), so
models with different tokenizers are compared in bits per byte: the total cross-entropy of the
text, in bits, divided by its UTF-8 byte count. Each target token is charged its own byte
length (special tokens count 0 bytes), so any subset of windows gives a consistent number.
In byte-level BPE every character of a token's string stands for exactly one byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.model.decoder import DecoderLM
from kvserve.tokenizer import Tokenizer


def token_byte_lengths(tokenizer: Tokenizer) -> torch.Tensor:
    """[vocab] UTF-8 bytes each token stands for; 0 for special tokens."""
    lengths = torch.zeros(tokenizer.vocab_size, dtype=torch.long)
    for tok, tid in tokenizer.hf.get_vocab(with_added_tokens=True).items():
        lengths[tid] = 0 if tid in tokenizer.all_special_ids else len(tok)
    return lengths


@dataclass
class EvalResult:
    loss: float              # nats per token
    bits_per_byte: float
    tokens: int
    bytes: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    def as_dict(self) -> dict:
        return {"loss": self.loss, "perplexity": self.perplexity, "bits_per_byte": self.bits_per_byte,
                "tokens": self.tokens, "bytes": self.bytes}


@torch.no_grad()
def paged_logits(model: DecoderLM, ids: torch.Tensor, chunk: int, kv_dtype: torch.dtype,
                 block_size: int = 16) -> torch.Tensor:
    """Logits [len(ids), V] of one sequence computed the way the engine serves it: through the
    paged KV cache (of `kv_dtype`), `chunk` tokens per forward pass (1: every token a decode step)."""
    from kvserve.model.attention import AttentionMetadata
    from kvserve.model.kv_quant import cache_shape

    cfg = model.config
    n = len(ids)
    blocks = (n + block_size - 1) // block_size
    kv = [torch.zeros(cache_shape(blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, kv_dtype), dtype=kv_dtype)
          for _ in range(cfg.num_hidden_layers)]
    table = list(range(blocks))
    out = []
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        meta = AttentionMetadata.build([e - s], [e], [table], block_size)
        out.append(model.compute_logits(model(ids[s:e], torch.arange(s, e), meta, kv)))
    return torch.cat(out)


@torch.no_grad()
def evaluate_stream(model: DecoderLM, ids: torch.Tensor, token_bytes: torch.Tensor, seq_len: int,
                    batch_size: int = 8, max_windows: int | None = None, paged_chunk: int | None = None,
                    kv_cache_dtype: torch.dtype = torch.float16) -> EvalResult:
    """Teacher-forced cross-entropy over consecutive non-overlapping windows of `ids`; with
    `paged_chunk`, each window goes through the serving path (paged_logits) instead of one
    cache-free forward pass."""
    was_training = model.training
    model.eval()
    n_win = max(1, (len(ids) - 1) // seq_len)
    if max_windows:
        n_win = min(n_win, max_windows)
    nats, tokens, nbytes = 0.0, 0, 0
    if paged_chunk:
        for w in range(n_win):
            x = ids[w * seq_len: w * seq_len + seq_len + 1]
            logits = paged_logits(model, x[:-1], paged_chunk, kv_cache_dtype)
            nats += float(F.cross_entropy(logits.float(), x[1:], reduction="sum"))
            tokens += len(x) - 1
            nbytes += int(token_bytes[x[1:]].sum())
        model.train(was_training)
        return EvalResult(nats / max(tokens, 1), nats / math.log(2) / max(nbytes, 1), tokens, nbytes)
    for start in range(0, n_win, batch_size):
        rows = []
        for w in range(start, min(n_win, start + batch_size)):
            rows.append(ids[w * seq_len: w * seq_len + seq_len + 1])
        width = min(len(r) for r in rows)
        x = torch.stack([r[:width] for r in rows])
        logits = model.compute_logits(model(x[:, :-1]))
        ce = F.cross_entropy(logits.transpose(1, 2).float(), x[:, 1:], reduction="sum")
        nats += float(ce)
        tokens += x[:, 1:].numel()
        nbytes += int(token_bytes[x[:, 1:]].sum())
    model.train(was_training)
    return EvalResult(nats / max(tokens, 1), nats / math.log(2) / max(nbytes, 1), tokens, nbytes)


def unigram_bits_per_byte(train_ids: torch.Tensor, eval_ids: torch.Tensor, token_bytes: torch.Tensor,
                          vocab_size: int) -> float:
    """The baseline a model must beat: token frequencies of the training stream (add-one
    smoothed) as the prediction for every held-out token, in bits per byte."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0
    logp = counts.log() - counts.sum().log()
    targets = eval_ids[1:]
    nats = -float(logp[targets].sum())
    return nats / math.log(2) / max(int(token_bytes[targets].sum()), 1)


def perplexity(model_dir: str | Path | None, text: str, seq_len: int | None = None, batch_size: int = 4,
               max_windows: int | None = None, weight_format: str = "fp32", paged_chunk: int | None = None,
               kv_cache_dtype: str = "fp16") -> EvalResult:
    """Perplexity and bits per byte of a model directory (or GGUF, or built-in name; None is the
    default model) on a text, with its weights in `weight_format` (fp32, bf16, fp16, auto, gguf);
    with `paged_chunk`, through the paged KV cache (`kv_cache_dtype`) that many tokens a pass."""
    from kvserve.engine.config import EngineConfig
    from kvserve.model.loader import load_model

    lm = load_model(str(model_dir) if model_dir else None, weight_format=weight_format)
    tok = lm.tokenizer
    ids = torch.tensor(tok.encode(text, add_special_tokens=True), dtype=torch.long)
    seq_len = min(seq_len or 512, lm.config.max_position_embeddings - 1)
    kv_dtype = EngineConfig(kv_cache_dtype=kv_cache_dtype).torch_kv_dtype
    return evaluate_stream(lm.model, ids, token_byte_lengths(tok), seq_len, batch_size, max_windows,
                           paged_chunk, kv_dtype)


def llama_cpp_perplexity(model: str | Path | None, text: str, seq_len: int | None = 512,
                         max_windows: int | None = None, threads: int | None = None) -> EvalResult:
    """llama.cpp's perplexity on exactly the token windows `perplexity` scores: the text is
    tokenized by kvserve, and llama.cpp evaluates those ids (logits for every position), each
    window from an empty cache, as `evaluate_stream` does. Needs a GGUF model."""
    import os

    import numpy as np

    from kvserve.errors import InvalidRequest
    from kvserve.model.gguf_loader import config_from_gguf, open_gguf
    from kvserve.model.registry import resolve

    try:
        from llama_cpp import Llama
    except ImportError:
        raise InvalidRequest("--peer llama-cpp needs llama-cpp-python: pip install 'kvserve[llama-cpp]'",
                             param="peer") from None
    src = resolve(str(model) if model else None)
    if src.kind != "gguf":
        raise InvalidRequest("--peer llama-cpp needs a GGUF model", param="peer")
    reader = open_gguf(src.path)
    tok = Tokenizer.from_gguf(reader)
    seq_len = min(seq_len or 512, config_from_gguf(reader, src.name).max_position_embeddings - 1)
    ids = tok.encode(text, add_special_tokens=True)
    token_bytes = token_byte_lengths(tok)
    n_win = max(1, (len(ids) - 1) // seq_len)
    if max_windows:
        n_win = min(n_win, max_windows)
    threads = threads or os.cpu_count() or 1
    llm = Llama(model_path=str(src.path), n_ctx=seq_len + 1, n_batch=seq_len, n_ubatch=seq_len, logits_all=True,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    nats, tokens, nbytes = 0.0, 0, 0
    for w in range(n_win):
        window = ids[w * seq_len: w * seq_len + seq_len + 1]
        llm.reset()
        llm.eval(window[:-1])
        logits = torch.from_numpy(np.array(llm.scores[: len(window) - 1], dtype=np.float32))
        targets = torch.tensor(window[1:], dtype=torch.long)
        nats += float(F.cross_entropy(logits, targets, reduction="sum"))
        tokens += len(targets)
        nbytes += int(token_bytes[targets].sum())
    llm.close()
    return EvalResult(nats / max(tokens, 1), nats / math.log(2) / max(nbytes, 1), tokens, nbytes)


def perplexity_table(rows: list[tuple[str, EvalResult]]) -> str:
    """Markdown: one row per (label, result), with the relative perplexity change from the first row."""
    ref = rows[0][1].perplexity
    out = ["| weights | perplexity | vs " + rows[0][0] + " | bits/byte | tokens |", "|---|---:|---:|---:|---:|"]
    for label, r in rows:
        out.append(f"| {label} | {r.perplexity:.4f} | {100 * (r.perplexity / ref - 1):+.2f}% | "
                   f"{r.bits_per_byte:.4f} | {r.tokens} |")
    return "\n".join(out)
