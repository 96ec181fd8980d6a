"""Draft-model proposer (`--speculative draft:PATH`): a small model sharing the target's tokenizer
(`kvserve train draft` makes one) guesses the next k tokens greedily.

Checked at startup: the path must load as a Llama-shaped model, and its tokenizer must be the
target's (same vocabulary, same ids), else drafts would be other tokens than the target scores.

The draft runs beside the engine, not inside its paged KV cache: each speculating request has
its own small dense KV cache here (a draft of 1-2 layers needs a few KB per token), keyed by
request id, holding the tokens it has seen. Every step the request's real sequence (prompt +
verified output) is compared with those tokens: the cache is cut back to their common prefix
(that is the rollback of rejected drafts), the tokens it has not seen are run as one chunk, then
k single-token steps propose the drafts. Proposals are the draft's argmax, a deterministic
function of the context, so for sampled requests the rejection sampler's point-mass rule (q_j =
1 on d_j) keeps sampling exact without the draft's probabilities.

The LM head may be restricted to a subset of the vocabulary (`draft_vocab.json`: the token ids
the target used most in the draft's training text): a 49k-row head would cost more than the
draft's layers. Drafts then come only from that subset; verification is unchanged, so exactness
does not depend on it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.engine.request import Request
from kvserve.errors import InvalidRequest

DRAFT_VOCAB_FILE = "draft_vocab.json"
_MAX_CACHED_REQUESTS = 64          # a safety bound: finished requests are forgotten by the scheduler


def same_tokenizer(a, b) -> bool:
    """Same vocabulary with the same ids (and the same end-of-sequence tokens)."""
    va = a.hf.get_vocab(with_added_tokens=True) if hasattr(a, "hf") else None
    vb = b.hf.get_vocab(with_added_tokens=True) if hasattr(b, "hf") else None
    return va == vb and list(a.eos_token_ids) == list(b.eos_token_ids)


class _Cache:
    """One request's draft KV: [layers, capacity, kv_heads, head_dim] keys and values."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int = 256):
        self.k = torch.zeros(layers, capacity, kv_heads, head_dim)
        self.v = torch.zeros_like(self.k)
        self.tokens: list[int] = []

    def reserve(self, n: int) -> None:
        cap = self.k.shape[1]
        if n > cap:
            new = max(n, 2 * cap)
            pad = torch.zeros(self.k.shape[0], new - cap, *self.k.shape[2:])
            self.k, self.v = torch.cat([self.k, pad]), torch.cat([self.v, pad.clone()])


class DraftModel:
    """The draft's incremental forward over a dense per-request cache (PyTorch, fp32)."""

    def __init__(self, model, vocab_ids: list[int] | None = None):
        cfg = model.config
        if (cfg.qk_norm or cfg.gemma_norms or cfg.num_experts or cfg.final_logit_softcapping
                or any(cfg.window_of(i) for i in range(cfg.num_hidden_layers)) or cfg.hidden_act != "silu"):
            raise InvalidRequest("a draft model must be a plain Llama-shaped model (no q/k norms, sliding "
                                 "windows, soft-capping or experts)", param="speculative")
        self.model = model
        self.cfg = cfg
        self.layers = list(model.layers)
        table = model.embed_tokens if model.embed_tokens is not None else model.embed(torch.arange(cfg.vocab_size))
        head = getattr(model.lm_head, "weight", None)
        if cfg.tie_word_embeddings or head is None or head.shape[0] != cfg.vocab_size:
            head = table
        self.vocab_ids = torch.tensor(vocab_ids if vocab_ids else range(cfg.vocab_size), dtype=torch.long)
        self.head = head.detach().float()[self.vocab_ids].contiguous()   # [N, H]
        self.embed_table = table.detach().float()
        self.max_len = cfg.max_position_embeddings

    def new_cache(self) -> _Cache:
        return _Cache(len(self.layers), self.cfg.num_key_value_heads, self.cfg.head_dim)

    @torch.no_grad()
    def forward(self, cache: _Cache, tokens: list[int]) -> int:
        """Run `tokens` after the cache's tokens; the draft's argmax token after the last of them."""
        start, T = len(cache.tokens), len(tokens)
        cache.reserve(start + T)
        cfg = self.cfg
        nh, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        pos = torch.arange(start, start + T)
        cos, sin = self.model.rotary(pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x = F.embedding(torch.tensor(tokens), self.embed_table)
        mask = None
        if T > 1:
            mask = torch.ones(T, start + T, dtype=torch.bool).tril(start)
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],), layer.input_layernorm.weight, layer.input_layernorm.eps)
            q, k, v = layer.qkv_proj(h).split([nh * d, kvh * d, kvh * d], dim=-1)
            q, k, v = q.view(T, nh, d), k.view(T, kvh, d), v.view(T, kvh, d)
            q = q * cos + torch.cat([-q[..., d // 2:], q[..., :d // 2]], -1) * sin
            k = k * cos + torch.cat([-k[..., d // 2:], k[..., :d // 2]], -1) * sin
            cache.k[i, start:start + T] = k
            cache.v[i, start:start + T] = v
            K = cache.k[i, :start + T].transpose(0, 1)                 # [kvh, S, d]
            V = cache.v[i, :start + T].transpose(0, 1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), K, V, attn_mask=mask, scale=layer.scale,
                                               enable_gqa=True)        # [nh, T, d]
            x = x + layer.o_proj(o.transpose(0, 1).reshape(T, nh * d))
            h = F.rms_norm(x, (x.shape[-1],), layer.post_attention_layernorm.weight,
                           layer.post_attention_layernorm.eps)
            g, u = layer.gate_up_proj(h).chunk(2, dim=-1)
            x = x + layer.down_proj(F.silu(g) * u)
        last = F.rms_norm(x[-1], (x.shape[-1],), self.model.norm.weight, self.model.norm.eps)
        cache.tokens.extend(tokens)
        return int(self.vocab_ids[int(torch.mv(self.head, last).argmax())])

    def propose(self, cache: _Cache, seq: list[int], k: int) -> list[int]:
        """Roll the cache back to its common prefix with `seq`, catch up, and draft k tokens."""
        n = 0
        limit = min(len(cache.tokens), len(seq) - 1)     # at least the last token is run again
        ct = cache.tokens
        while n < limit and ct[n] == seq[n]:
            n += 1
        del ct[n:]
        k = min(k, self.max_len - len(seq))
        if k <= 0:
            return []
        out = [self.forward(cache, seq[n:])]
        while len(out) < k:
            out.append(self.forward(cache, out[-1:]))
        return out


class DraftProposer:
    """The Proposer over a DraftModel: one dense cache per speculating request."""

    def __init__(self, draft: DraftModel):
        self.draft = draft
        self.caches: OrderedDict[str, _Cache] = OrderedDict()

    def propose(self, batch: Sequence[tuple[Request, int]]) -> list[list[int]]:
        out = []
        for r, k in batch:
            cache = self.caches.pop(r.request_id, None) or self.draft.new_cache()
            self.caches[r.request_id] = cache              # most recently used last
            out.append(self.draft.propose(cache, r.prompt_token_ids + r.output_token_ids, k))
        while len(self.caches) > _MAX_CACHED_REQUESTS:
            self.caches.popitem(last=False)
        return out

    def forget(self, request_id: str) -> None:
        self.caches.pop(request_id, None)

    @classmethod
    def load(cls, config, target_model, target_tokenizer) -> DraftProposer:
        from kvserve.model.loader import load_model
        try:
            draft = load_model(config.draft_path, weight_format="fp32")
        except Exception as e:  # noqa: BLE001 - any load failure is the user's path
            raise InvalidRequest(f"cannot load the draft model {config.draft_path!r}: {e}",
                                 param="speculative") from None
        if target_tokenizer is not None and not same_tokenizer(draft.tokenizer, target_tokenizer):
            raise InvalidRequest(f"the draft model {config.draft_path!r} has a different tokenizer than the "
                                 "target model: a draft must share the target's vocabulary", param="speculative")
        if draft.config.vocab_size != target_model.config.vocab_size:
            raise InvalidRequest(f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the "
                                 f"target's ({target_model.config.vocab_size})", param="speculative")
        vocab = None
        vf = Path(config.draft_path) / DRAFT_VOCAB_FILE
        if vf.is_file():
            vocab = json.loads(vf.read_text())["token_ids"]
            if not vocab or min(vocab) < 0 or max(vocab) >= draft.config.vocab_size:
                raise InvalidRequest(f"{vf}: token ids outside the vocabulary", param="speculative")
        return cls(DraftModel(draft.model, vocab))
