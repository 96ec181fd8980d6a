"""Draft-model proposer (`--speculative draft:PATH`): a small model sharing the target's tokenizer
(`kvserve train draft` makes one) guesses the next k tokens greedily.

Checked at startup: the path must load as a Llama-shaped model, and its tokenizer must be the
target's (same vocabulary, same ids), else drafts would be other tokens than the target scores.

The draft runs beside the engine with a paged KV cache of its own (a small block pool: a draft
of 1-2 layers needs a few KB per token), on the same model code as the target: its weights are
packed into Q8_0 blocks at load (`weight_format="q8_0"`; `draft_weight_format="q4_1"` takes
Q4_1 blocks, 0.63 of the bytes), so on a CPU with the C kernels the
draft's whole layer stack is one C call over int8 weights, as the target's is. The speculating
requests of a step are drafted together: one batched forward for every request's catch-up
tokens, then one per further draft position. Each request's cache holds the tokens it has
seen; every step the request's real sequence (prompt + verified output) is compared with those
tokens, the cache is cut back to their common prefix (the rollback of rejected drafts), and the
tokens it has not seen are run. Proposals are the draft's argmax, a deterministic function of
the context, so for sampled requests the rejection sampler's point-mass rule (q_j = 1 on d_j)
keeps sampling exact without the draft's probabilities. When the pool is full, the least
recently drafted other requests' caches are dropped (they catch up again later); a request that
still does not fit gets no drafts that step.

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

from kvserve.engine.request import Request
from kvserve.engine.sampler import greedy_ids
from kvserve.engine.spec_decode.proposer import HiddenSink
from kvserve.errors import InvalidRequest
from kvserve.model.attention import AttentionMetadata
from kvserve.model.kv_quant import cache_shape
from kvserve.model.linear import WeightSource, make_linear
from kvserve.model.loader import load_model

DRAFT_VOCAB_FILE = "draft_vocab.json"
_MAX_CACHED_REQUESTS = 64          # a safety bound: finished requests are forgotten by the scheduler


def same_tokenizer(a, b) -> bool:
    """Same vocabulary with the same ids (and the same end-of-sequence tokens)."""
    va = a.hf.get_vocab(with_added_tokens=True) if hasattr(a, "hf") else None
    vb = b.hf.get_vocab(with_added_tokens=True) if hasattr(b, "hf") else None
    return va == vb and list(a.eos_token_ids) == list(b.eos_token_ids)


def _common_prefix(a: list[int], seq: list[int], off: int, limit: int) -> int:
    """How many of a[:limit] equal seq[off:off + limit], from the start. A draft's cache differs from
    the sequence only in its last few tokens (drafts since rejected), so the tail is tried first and
    whole runs are compared as list slices (C speed): a token-by-token loop over the whole cache each
    step cost ~3 us per 100 tokens warm, several times that right after a forward."""
    n = limit
    for back in (0, 1, 2, 4, 8, 16, 32):
        m = max(0, limit - back)
        if a[:m] == seq[off:off + m]:
            n = m
            break
    else:
        n = 0
    while n < limit and a[n] == seq[off + n]:
        n += 1
    return n


class _Cache:
    """One request's place in the draft's paged KV cache: the tokens whose K/V it holds, and the
    blocks they are in."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.blocks: list[int] = []


class DraftPool:
    """A draft's paged KV cache: fp16 block tensors per layer and a free list. A request's cache
    (anything with `blocks` and `reset()`) takes blocks as it grows and gives them all back when
    dropped; `admit` makes room for a step's batch by dropping the least recently drafted other
    requests' caches (they catch up again when they next draft)."""

    def __init__(self, cfg, num_blocks: int, block_size: int):
        dtype = torch.float16
        self.block_size = block_size
        self.kv_caches = [torch.empty(cache_shape(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                                                  dtype), dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.free = list(range(num_blocks - 1, -1, -1))

    def blocks_for(self, cache, n: int) -> int:
        return -(-n // self.block_size) - len(cache.blocks)

    def reserve(self, cache, n: int) -> bool:
        """Blocks for `n` tokens in `cache`; False (nothing taken) if the pool has too few."""
        need = self.blocks_for(cache, n)
        if need > len(self.free):
            return False
        for _ in range(need):
            cache.blocks.append(self.free.pop())
        return True

    def release(self, cache) -> None:
        self.free += reversed(cache.blocks)
        cache.reset()

    def admit(self, caches: OrderedDict, batch: list[tuple[object, int]]) -> None:
        """batch: (cache, tokens it will hold) of this step's requests, already the most recent in
        `caches` (request id -> cache, least recently drafted first)."""
        mine = {id(c) for c, _ in batch}
        need = sum(self.blocks_for(c, n) for c, n in batch)
        for rid in list(caches):
            if len(self.free) >= need or len(caches) <= len(batch):
                break
            if id(caches[rid]) not in mine:
                self.release(caches.pop(rid))
        while len(caches) > max(_MAX_CACHED_REQUESTS, len(batch)):
            self.release(caches.popitem(last=False)[1])


class DraftModel:
    """The draft's forward over its own paged KV cache, batched over the speculating requests:
    the same model code (and, on a CPU with the C kernels, the same one-call layer stack over
    int8 weights) as the target, with a small block pool of its own."""

    def __init__(self, model, vocab_ids: list[int] | None = None, num_blocks: int = 2048, block_size: int = 16,
                 weight_format: str = "q8_0"):
        """weight_format: what the head rows (and an EAGLE head's fc) are packed into, as the model's
        projections were at load (SpeculativeConfig.draft_weight_format)."""
        cfg = model.config
        self.check_shape(cfg)
        self.model = model
        self.cfg = cfg
        self.vocab_ids = torch.tensor(vocab_ids if vocab_ids else range(cfg.vocab_size), dtype=torch.long)
        self.head = self.head_of(model, self.vocab_ids, weight_format)
        self.max_len = cfg.max_position_embeddings
        self.pool = DraftPool(cfg, num_blocks, block_size)

    @staticmethod
    def check_shape(cfg) -> None:
        if (cfg.qk_norm or cfg.gemma_norms or cfg.num_experts or cfg.final_logit_softcapping
                or any(cfg.window_of(i) for i in range(cfg.num_hidden_layers)) or cfg.hidden_act != "silu"):
            raise InvalidRequest("a draft model must be a plain Llama-shaped model (no q/k norms, sliding "
                                 "windows, soft-capping or experts)", param="speculative")

    @staticmethod
    def head_of(model, ids: torch.Tensor, weight_format: str = "q8_0"):
        """The LM head's rows `ids`, packed like the projections where the C kernels run."""
        if model.lm_head is model.packed_embed or model.config.tie_word_embeddings:
            rows = model.embed(ids)
        else:
            w = getattr(model.lm_head, "weight", None)
            rows = w.detach().float()[ids] if w is not None else model.embed(ids)
        return make_linear(WeightSource(tuple(rows.shape), tensor=rows.contiguous()), None, weight_format,
                           backend=model.backend)

    def new_cache(self) -> _Cache:
        return _Cache()

    @torch.no_grad()
    def _step(self, items: list[tuple[_Cache, list[int]]]) -> list[int]:
        """Run each cache's new tokens after its cached ones (one batched forward); the draft's
        argmax after each item's last token."""
        q_lens = [len(t) for _, t in items]
        seq_lens = [len(c.tokens) + len(t) for c, t in items]
        ids = torch.tensor([x for _, t in items for x in t], dtype=torch.long)
        pos = torch.tensor([p for c, t in items for p in range(len(c.tokens), len(c.tokens) + len(t))],
                           dtype=torch.long)
        meta = AttentionMetadata.build(q_lens, seq_lens, [c.blocks for c, _ in items], self.pool.block_size)
        hidden = self.model(ids, pos, meta, self.pool.kv_caches)
        last = torch.tensor(q_lens).cumsum(0) - 1
        logits = self.head(hidden[last].contiguous())
        for c, t in items:
            c.tokens.extend(t)
        return self.vocab_ids[greedy_ids(logits)].tolist()

    def propose_batch(self, work: list[tuple[_Cache, list[int], int]]) -> list[list[int]]:
        """work: (cache, sequence, k) per request. Each cache is rolled back to its common prefix
        with the sequence (the rollback of rejected drafts), catches up, and drafts k tokens."""
        out: list[list[int]] = [[] for _ in work]
        live = []
        for i, (cache, seq, k) in enumerate(work):
            ct = cache.tokens
            n = _common_prefix(ct, seq, 0, min(len(ct), len(seq) - 1))   # at least the last token runs again
            del ct[n:]
            k = min(k, self.max_len - len(seq))
            if k > 0 and self.pool.reserve(cache, len(seq) + k - 1):
                live.append((i, cache, seq[n:], k))
        if not live:
            return out
        nxt = self._step([(c, new) for _, c, new, _ in live])
        for (i, *_), t in zip(live, nxt):
            out[i].append(t)
        for j in range(1, max(k for *_, k in live)):
            live = [x for x in live if x[3] > j]
            nxt = self._step([(c, out[i][-1:]) for i, c, _, _ in live])
            for (i, *_), t in zip(live, nxt):
                out[i].append(t)
        return out


class DraftProposer:
    """The Proposer over a DraftModel: one dense cache per speculating request."""

    hidden_sink: HiddenSink | None = None

    def __init__(self, draft: DraftModel):
        self.draft = draft
        self.caches: OrderedDict[str, _Cache] = OrderedDict()

    def _take(self, batch: Sequence[tuple[Request, int]]) -> list[tuple[object, list[int], int]]:
        """(cache, sequence, k) per request, the pool made room for them."""
        work = []
        for r, k in batch:
            cache = self.caches.pop(r.request_id, None) or self.draft.new_cache()
            self.caches[r.request_id] = cache              # most recently used last
            work.append((cache, r.prompt_token_ids + r.output_token_ids, k))
        self.draft.pool.admit(self.caches, [(c, len(seq) + k) for c, seq, k in work])
        return work

    def propose(self, batch: Sequence[tuple[Request, int]]) -> list[list[int]]:
        return self.draft.propose_batch(self._take(batch))

    def forget(self, request_id: str) -> None:
        cache = self.caches.pop(request_id, None)
        if cache is not None:
            self.draft.pool.release(cache)

    @classmethod
    def load(cls, config, target_model, target_tokenizer) -> DraftProposer:
        """The proposer for `config.draft_path`, checked at startup (the draft loads, has the target's
        tokenizer and vocabulary); the subclass's `build` makes it."""
        try:
            draft = load_model(config.draft_path, weight_format=config.draft_weight_format,
                               backend=target_model.backend)
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
        return cls.build(config.draft_path, draft.model, vocab, target_model, config.draft_weight_format)

    @classmethod
    def build(cls, path: str, draft_model, vocab: list[int] | None, target_model,
              weight_format: str = "q8_0") -> DraftProposer:
        return cls(DraftModel(draft_model, vocab, weight_format=weight_format))
