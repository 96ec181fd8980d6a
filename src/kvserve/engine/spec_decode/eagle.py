"""EAGLE-style draft (`--speculative draft:DIR` where DIR holds `eagle_fc.safetensors`): a draft
that reads the target's own features instead of starting from the tokens alone.

The feature f_j is the target's final hidden state at position j (after the final norm: what
its LM head turns into the distribution of token j+1). The draft at position j takes
fc([f_j ; e(x_{j+1})]) (the feature and the embedding of the token that followed, 2H -> H) through
one decoder layer of the target's shape and its own final norm, and predicts x_{j+2} with the
target's (tied) head restricted to the draft vocabulary. Its output is trained to be f_{j+1} as
well, so a draft step feeds its own output as the next step's feature (and the steps are trained
chained as they run here: train/draft_eagle.py's EagleHead.chain):

    step 1   position L-2: fc([f_{L-2} ; e(x_{L-1})]) -> d_1, h_1     (x_{L-1}: the newest token)
    step i   position L-3+i: fc([h_{i-1} ; e(d_{i-1})]) -> d_i, h_i

With `eagle_config.json` listing `feature_layers` (EAGLE-3's idea), f_j is instead the final
hidden state followed by the residual stream after those target layers, each RMS-normalised
(`draft_features`; the target's forward copies them out normalised, `forward_features`), and
fc reads (2 + n) H values; later draft steps pair the head's own output with the inner layers of the
newest position the target computed. Same data, same steps: 0.33 -> 0.41 agreement on the open
prompts of `bench latency` with layers 2, 14 and 26 (BENCHMARKS.md, issue 16).

Features come from the engine: the proposer's `hidden_sink` asks the model runner for every
step's hidden rows (and those layers'), handed to `observe_hidden`, which keeps them per request by position. A position's latest row is always
the verified one: a rejected draft's row sits at the position of the token that replaced it, and
that token is run (and its row written again) before its feature is needed. Positions the target
never computed for this request (a prefix-cache hit) have no feature: the draft's own cache then
starts at the first position that has one, and at most `_MAX_CATCHUP` positions before the newest
(a request that has not drafted for longer than that starts its cache over there).

The draft's KV cache is paged (a pool of its own, like the plain draft's): each request's cache
holds the positions computed from true features; the draft steps' positions are written too but
not kept, so the next step recomputes them from the target's features.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvserve.engine.request import Request
from kvserve.engine.sampler import greedy_ids
from kvserve.engine.spec_decode.draft import DraftModel, DraftProposer, _common_prefix
from kvserve.engine.spec_decode.proposer import HiddenSink
from kvserve.errors import InvalidRequest
from kvserve.model.attention import AttentionMetadata
from kvserve.model.linear import WeightSource, make_linear

EAGLE_FILE = "eagle_fc.safetensors"
# Optional: {"feature_layers": [i, ...]}: the head also reads the residual stream after these target
# layers (EAGLE-3's low, middle and high features), each RMS-normalised, after the final feature.
EAGLE_CONFIG = "eagle_config.json"


def draft_features(hidden: torch.Tensor, captured: torch.Tensor | None) -> torch.Tensor:
    """A step's feature rows as the head reads them: the final hidden state [T, H], then each
    captured inner layer [T, n, H] (the forward has RMS-normalised them, model.decoder.FeatureNorm)."""
    if captured is None or captured.shape[1] == 0:
        return hidden
    return torch.cat([hidden, captured.reshape(hidden.shape[0], -1)], -1)


# A draft step reruns at most this many positions of a request before its newest token: a first
# draft after a long prompt, or one after a long pause, would otherwise run the draft over all of
# them (6-8 ms for 300 tokens, against a 0.5 ms draft step); further behind, its cache starts over.
# The head reads the target's features, which saw everything: first-draft acceptance on the
# grounded prompts of `bench latency` (K = 1, cost gate off) was 0.19 from the whole prompt,
# 0.17-0.23 from its last 64 positions, 0.21 from 16.
_MAX_CATCHUP = 64

# Features kept per request beyond what its draft cache holds: a request that does not draft for a
# long time (a big batch, a long prompt, a pause) keeps only its newest rows (a draft step never
# reaches further back than _MAX_CATCHUP), 4.6 KB each with three inner layers.
_MAX_FEATURE_ROWS = 4 * _MAX_CATCHUP


class _Features:
    """One request's target features by position, from `origin` on. The sink keeps each step's rows
    by reference (the step's hidden and captured tensors and the request's first row in them: no
    copy, no torch op in a step that does not draft; 38 -> ~5 us a step, Zen 5); `get` gives the
    rows a draft step reads, as float32 (training rounded them to fp16, a difference of 2^-11 that
    costs acceptance nothing and a conversion a step): a slice of the newest step's rows where it
    holds them all, else a copy. Positions are computed contiguously and a
    position's newest row is the one that counts (a rejected draft's row is computed again with
    the token that replaced it before a draft reads it)."""

    def __init__(self, width: int):
        self.width = width
        self.origin: int | None = None
        self.end = 0                      # one past the last position written
        # (first position, rows, step's final rows [T, H], its inner layers' [T, n, H] or None, first row)
        self.chunks: list[tuple[int, int, torch.Tensor, torch.Tensor | None, int]] = []

    def put(self, start: int, rows: torch.Tensor, inner: torch.Tensor | None = None, row: int = 0,
            n: int | None = None) -> None:
        """Positions start.. have the features [rows[row + i] ; inner[row + i] flattened], i < n."""
        n = rows.shape[0] - row if n is None else n
        if self.origin is None:
            self.origin = start
        if n <= 0 or start + n <= self.origin:
            return
        self.chunks.append((start, n, rows, inner, row))
        self.end = max(self.end, start + n)

    def get(self, a: int, b: int) -> torch.Tensor | None:
        """Rows for positions [a, b) as float32 [b - a, width], or None if any is missing."""
        if self.origin is None or a < self.origin or b > self.end:
            return None
        start, n, rows, inner, row = self.chunks[-1]
        if start <= a and b <= start + n:    # the newest step holds them all (a drafting request's usual
            r = row + a - start              # case): one op, not an empty tensor and a copy per part
            if inner is None:
                return rows[r:r + b - a].float()
            return torch.cat((rows[r:r + b - a], inner[r:r + b - a].flatten(1)), 1).float()
        out = torch.empty(b - a, self.width)
        lo = hi = None                    # what newer chunks cover: starts never decrease, so [lo, hi)
        for start, n, rows, inner, row in reversed(self.chunks):
            end = start + n
            for s, e in ([(start, end)] if lo is None else [(start, lo), (hi, end)]):
                s, e = max(s, a), min(e, b)
                if s < e:
                    r = row + s - start
                    H = rows.shape[1]
                    out[s - a:e - a, :H] = rows[r:r + e - s]
                    if inner is not None:
                        out[s - a:e - a, H:] = inner[r:r + e - s].reshape(e - s, -1)
            lo, hi = (start, end) if lo is None else (min(lo, start), max(hi, end))
            if lo <= a and hi >= b:
                break
        return out

    def trim(self, upto: int) -> None:
        """Forget positions before `upto` (the draft's cache holds them)."""
        if self.origin is None or upto <= self.origin:
            return
        self.origin = upto
        self.chunks = [c for c in self.chunks if c[0] + c[1] > upto]


class _Cache:
    """One request's positions in the draft's paged KV cache: from `origin`, `tokens[i]` is the token
    x_{origin+i+1} that position origin+i was computed with (from the target's feature)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.origin: int | None = None
        self.tokens: list[int] = []
        self.blocks: list[int] = []


class EagleModel(DraftModel):
    """fc + one decoder layer + norm + the kept head rows; the layer stack on the model code (the
    C forward over Q8_0-packed weights where the kernels are; fc and the head packed alike), a
    paged KV pool of its own. Where the C kernels run, a draft step is one call (fc, the layer, the
    head and argmax: CpuOps.draft_step, the same numbers): 0.19 ms of a 0.26 ms step is then the
    C code reading the draft's ~8 MB of weights, against 0.42 ms for the pieces one by one (Zen 5)."""

    def __init__(self, model, fc: torch.Tensor, embed, vocab_ids: list[int] | None = None,
                 num_blocks: int = 2048, block_size: int = 16, num_inner: int = 0, embed_rows=None,
                 weight_format: str = "q8_0"):
        """embed: token ids -> embedding rows (the target's); embed_rows: the packed Linear whose rows
        they are, if any (the draft step then runs as one C call, CpuOps.draft_step)."""
        H = model.config.hidden_size
        if tuple(fc.shape) != (H, (2 + num_inner) * H):
            raise InvalidRequest(f"{EAGLE_FILE}: fc must be [{H}, {(2 + num_inner) * H}] for {num_inner} inner "
                                 f"feature layers, got {list(fc.shape)}", param="speculative")
        super().__init__(model, vocab_ids, num_blocks, block_size, weight_format)
        self.embed = embed
        self.num_inner = num_inner
        # fc packed like the head: an fp32 fc (2.7 MB) read from memory every draft step cost more
        # than the draft's decoder layer (0.25 against 0.05 ms in the engine, Zen 5)
        self.fc = make_linear(WeightSource(tuple(fc.shape), tensor=fc.float().contiguous()), None, weight_format,
                              backend=model.backend)
        self.embed_rows = embed_rows
        self._vocab_list = self.vocab_ids.tolist()
        self.fused = True         # the one-call step where the C kernels take it (tests compare both ways)

    def new_cache(self) -> _Cache:
        return _Cache()

    @torch.no_grad()
    def _step(self, items: list[tuple[_Cache, int, torch.Tensor, list[int]]]) -> tuple[list[int], torch.Tensor]:
        """items: (cache, first position, features [n, (1 + num_inner) H], next tokens [n]) per request; runs the
        positions and returns each item's draft token after its last position and that row's output."""
        feats = items[0][2] if len(items) == 1 else torch.cat([f for _, _, f, _ in items])
        q_lens = [len(t) for *_, t in items]
        # positions count from each cache's origin (slots and RoPE alike: attention scores depend only
        # on distances, so a cache that starts after a prefix-cache hit needs no shift)
        ends = [p0 - c.origin + len(t) for c, p0, _, t in items]
        toks = [x for *_, t in items for x in t]
        pos = [p for e, q in zip(ends, q_lens) for p in range(e - q, e)]
        if self.fused and self.embed_rows is not None:
            done = self._fused_step(items, feats, q_lens, ends, toks, pos)
            if done is not None:
                return done
        ids = torch.tensor(toks, dtype=torch.long)
        x = self.fc(torch.cat([feats, self.embed(ids)], -1))
        meta = AttentionMetadata.build(q_lens, ends, [c.blocks for c, *_ in items], self.pool.block_size)
        hidden = self.model(ids, torch.tensor(pos, dtype=torch.long), meta, self.pool.kv_caches, inputs_embeds=x)
        last = hidden[torch.tensor(meta.query_start_loc[1:]) - 1].contiguous()
        return self.vocab_ids[greedy_ids(self.head(last))].tolist(), last

    def _fused_step(self, items, feats: torch.Tensor, q_lens: list[int], ends: list[int], toks: list[int],
                    pos: list[int]) -> tuple[list[int], torch.Tensor] | None:
        """_step as one C call (fc, the layer, the head and argmax: CpuOps.draft_step), its step
        layout as lists (no tensor per index); None where the C kernels do not take it."""
        step = getattr(self.model.layer_ops(), "draft_step", None)
        if step is None:
            return None
        qsl, slots, tables, width = AttentionMetadata.layout(q_lens, ends, [c.blocks for c, *_ in items],
                                                             self.pool.block_size)
        seq_of = [i for i, q in enumerate(q_lens) for _ in range(q)]
        out = step(feats, toks, self.embed_rows, self.fc, self.head, pos, slots, seq_of, tables, width,
                   [e - 1 for e in qsl[1:]], self.pool.kv_caches)
        if out is None:
            return None
        arg, hidden = out
        return [self._vocab_list[i] for i in arg.tolist()], hidden

    def propose_batch(self, work: list[tuple[_Cache, _Features, list[int], int]]) -> list[list[int]]:
        """work: (cache, the request's features, its sequence, k) per request."""
        out: list[list[int]] = [[] for _ in work]
        live = []
        for i, (cache, feats, seq, k) in enumerate(work):
            L = len(seq)
            if feats.origin is None:
                continue
            start = max(feats.origin, L - 1 - _MAX_CATCHUP)   # the earliest position a step reruns
            if cache.origin is None:
                cache.origin = start
            o = cache.origin
            if L - 2 < o:
                continue
            ct = cache.tokens                          # roll back to the common prefix (verified tokens)
            n = _common_prefix(ct, seq, o + 1, min(len(ct), L - 2 - o))   # position L-2 always runs again
            del ct[n:]
            if o + n < start:     # behind by more than _MAX_CATCHUP (a long pause), or its features were
                self.pool.release(cache)               # dropped: start over near the newest position
                cache.origin = o = start
                n = 0
            f = feats.get(o + n, L - 1)
            k = min(k, self.max_len - L)
            if f is None or k <= 0 or not self.pool.reserve(cache, L - 1 - o + k - 1):
                continue
            live.append((i, cache, o + n, f, seq[o + n + 1:L], k))
        if not live:
            return out
        toks, h = self._step([(c, p0, f, t) for _, c, p0, f, t, _ in live])
        for row, (i, c, p0, f, t, k) in enumerate(live):
            out[i].append(toks[row])
            c.tokens.extend(t)
            work[i][1].trim(p0 + len(t))
        depth = max(x[-1] for x in live)
        if depth == 1:
            return out
        # a later draft step's feature: the head's own output for the final one, and the inner layers
        # of the newest position the target computed (the draft's own positions have none)
        H = self.cfg.hidden_size
        inner = {i: f[-1:, H:].float() for i, c, p0, f, t, k in live} if self.num_inner else {}

        def feature(i: int) -> torch.Tensor:
            return torch.cat([state[i][2], inner[i]], -1) if self.num_inner else state[i][2]

        state = {i: (c, p0 + len(t), h[row:row + 1]) for row, (i, c, p0, f, t, k) in enumerate(live)}
        for j in range(1, depth):
            now = [i for i, *_, k in live if k > j]
            items = [(state[i][0], state[i][1] + j - 1, feature(i), out[i][-1:]) for i in now]
            toks, h = self._step(items)
            for row, i in enumerate(now):
                out[i].append(toks[row])
                state[i] = (state[i][0], state[i][1], h[row:row + 1])
        return out


class EagleProposer(DraftProposer):
    """The Proposer over an EagleModel; `observe_hidden` is the model runner's hidden sink, over
    the target's `layers` (its inner feature layers)."""

    def __init__(self, draft: EagleModel, layers: tuple[int, ...] = ()):
        super().__init__(draft)
        self.features: dict[str, _Features] = {}
        self.hidden_sink = HiddenSink(self.observe_hidden, tuple(layers))

    def observe_hidden(self, scheduled, hidden: torch.Tensor, captured: torch.Tensor | None = None) -> None:
        inner = captured if self.draft.num_inner else None
        width = (1 + self.draft.num_inner) * hidden.shape[-1]
        row = 0
        for s in scheduled:
            n, req = s.num_new_tokens, s.request
            if req.params.speculative:
                f = self.features.get(req.request_id)
                if f is None:
                    f = self.features[req.request_id] = _Features(width)
                f.put(s.num_computed_tokens, hidden, inner, row, n)
                if f.end - f.origin > _MAX_FEATURE_ROWS:
                    f.trim(f.end - _MAX_FEATURE_ROWS // 2)
            row += n

    def propose(self, batch: Sequence[tuple[Request, int]]) -> list[list[int]]:
        work = self._take(batch)
        width = (1 + self.draft.num_inner) * self.draft.cfg.hidden_size
        feats = [self.features.get(r.request_id) or _Features(width) for r, _ in batch]
        return self.draft.propose_batch([(c, f, seq, k) for (c, seq, k), f in zip(work, feats)])

    def forget(self, request_id: str) -> None:
        self.features.pop(request_id, None)
        super().forget(request_id)

    @classmethod
    def build(cls, path: str, draft_model, vocab: list[int] | None, target_model,
              weight_format: str = "q8_0") -> EagleProposer:
        try:
            fc = load_file(str(Path(path) / EAGLE_FILE))["fc.weight"]
        except (SafetensorError, OSError, KeyError) as e:
            raise InvalidRequest(f"cannot read {Path(path) / EAGLE_FILE}: {e}", param="speculative") from None
        layers = feature_layers(path, target_model.config.num_hidden_layers)
        return cls(EagleModel(draft_model, fc, target_model.embed, vocab, num_inner=len(layers),
                              embed_rows=target_model.packed_embedding(), weight_format=weight_format), layers)


def feature_layers(path: str, num_layers: int) -> tuple[int, ...]:
    """The inner layers a head in `path` reads (EAGLE_CONFIG; none without the file), checked."""
    f = Path(path) / EAGLE_CONFIG
    if not f.is_file():
        return ()
    try:
        layers = json.loads(f.read_text()).get("feature_layers", [])
    except (OSError, ValueError, AttributeError) as e:
        raise InvalidRequest(f"cannot read {f}: {e}", param="speculative") from None
    if (not isinstance(layers, list) or len(set(layers)) != len(layers)
            or not all(isinstance(i, int) and 0 <= i < num_layers for i in layers)):
        raise InvalidRequest(f"{f}: feature_layers must be distinct target layer indices below {num_layers}, "
                             f"got {layers!r}", param="speculative")
    return tuple(layers)
