"""Issue 58: random-weight GGUFs of the Gemma 2, Gemma 3, Llama 2, Mistral and Phi-3 shapes
(kvserve/bench/gguf_random.py, written as llama.cpp's converter lays them out: Gemma norms stored as
1 + w, head_dim 256 beside a narrower hidden size, GQA, sliding-window layers beside global ones,
Gemma 2's soft-caps, Gemma 3's q/k norms and local RoPE base, Phi-3's fused qkv and gate/up) read
by kvserve and by transformers (`from_pretrained(dir, gguf_file=...)`, fp32) from the same file.

* kvserve's fp32 path (weights dequantized to fp32, paged fp32 KV cache, PyTorch layer ops) gives
  transformers' greedy continuation token for token, its logits within float32 rounding.
* The default path (packed weights, int8 activations in the matmuls as llama.cpp's, fp16 KV) gives
  it up to near-ties: where the continuations part, transformers' own top-2 gap is small.

Where transformers' GGUF reader drops a field, the test says so and fills it in from the file:
it reads no `{arch}.attention.sliding_window` for llama/phi3, reads architecture `llama` as
Mistral only when `general.name` is exactly "mistral", and Phi3Config's default pad_token_id
(32000) lies outside a 4096-token vocabulary.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kvserve.bench import gguf_random
from kvserve.model.attention import AttentionMetadata
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.loader import load_model

transformers = pytest.importorskip("transformers")

SHAPES = ["gemma2-tiny", "gemma3-tiny", "llama2-tiny", "mistral-tiny", "phi3-tiny"]
PROMPT, NEW, BLOCK = 24, 16, 8          # 40 positions: past every shape's window (16, 24)
NEAR_TIE = 0.15                         # transformers' logprob gap where the default path may part


@pytest.fixture(scope="module", params=SHAPES)
def case(request, tmp_path_factory):
    shape = request.param
    d = tmp_path_factory.mktemp(shape)
    path = gguf_random.write(d / f"{shape}.gguf", shape, "Q8_0", seed=1)
    s = gguf_random.Shape(*gguf_random.SHAPES[shape])
    logging.getLogger("transformers").setLevel(logging.ERROR)
    kw = {"sliding_window": s.window, "pad_token_id": 0} if s.arch == "phi3" else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=path.name, dtype=torch.float32, **kw)
    if s.name == "mistral":   # read as Llama (general.name is not exactly "mistral"): same tensors, the window
        c = transformers.MistralConfig(**{**hf.config.to_dict(), "sliding_window": s.window,
                                          "architectures": ["MistralForCausalLM"], "model_type": "mistral"})
        m = transformers.MistralForCausalLM(c)
        m.load_state_dict(hf.state_dict())
        hf = m
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, s.vocab - 3, (PROMPT,), generator=g).tolist()
    return path, hf.eval(), prompt


def _hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    ids, rows = list(prompt), []
    with torch.no_grad():
        for _ in range(NEW):
            row = hf(torch.tensor([ids])).logits[0, -1]
            rows.append(row)
            ids.append(int(row.argmax()))
    return ids[len(prompt):], rows


def _greedy(model, prompt: list[int], kv_dtype: torch.dtype) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill in two chunks, then decode one token a step over a paged cache (blocks out of order)."""
    cfg = model.config
    blocks = (PROMPT + NEW) // BLOCK + 1
    table = list(range(blocks))[::-1]
    kv = [torch.zeros(2, blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype=kv_dtype)
          for _ in range(cfg.num_hidden_layers)]
    out, rows, done = [], [], 0
    with torch.inference_mode():
        for ids in (prompt[:PROMPT // 2], prompt[PROMPT // 2:]):
            meta = AttentionMetadata.build([len(ids)], [done + len(ids)], [table], BLOCK)
            hidden = model(torch.tensor(ids), torch.arange(done, done + len(ids)), meta, kv)
            done += len(ids)
        for _ in range(NEW):
            row = model.compute_logits(hidden[-1:])[0]
            rows.append(row)
            out.append(int(row.argmax()))
            meta = AttentionMetadata.build([1], [done + 1], [table], BLOCK)
            hidden = model(torch.tensor([out[-1]]), torch.tensor([done]), meta, kv)
            done += 1
    return out, rows


def test_fp32_path_equals_transformers(case):
    path, hf, prompt = case
    want, want_rows = _hf_greedy(hf, prompt)
    model = load_model(str(path), "fp32", backend=KernelBackend.pytorch()).model
    got, rows = _greedy(model, prompt, torch.float32)
    assert got == want
    for a, b in zip(rows, want_rows):
        assert (a - b).abs().max().item() < 1e-4
    with torch.no_grad():                # the random model says more than one thing over the prompt
        assert len(set(hf(torch.tensor([prompt])).logits[0].argmax(-1).tolist())) > 3


@pytest.mark.slow   # a second load of each file on the kernels: ~5 s CPU a shape, minutes on a busy machine
def test_default_path_equals_transformers_up_to_near_ties(case):
    path, hf, prompt = case
    want, _ = _hf_greedy(hf, prompt)
    got, _ = _greedy(load_model(str(path)).model, prompt, torch.float16)
    if got != want:
        k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([prompt + want[:k]])).logits[0, -1], -1)
        gap = (lp[want[k]] - lp[got[k]]).item()
        assert gap < NEAR_TIE, f"parted at step {k} where transformers' gap is {gap:.3f}"


@pytest.mark.parametrize("arch,layers,hidden,heads,scalar", [
    ("gemma2", 26, 2304, 8, 256.0), ("gemma2", 46, 4608, 32, 144.0),     # Gemma-2-2B, Gemma-2-27B
    ("gemma3", 26, 1152, 4, 256.0), ("gemma3", 62, 5376, 32, 168.0)])    # Gemma-3-1B, Gemma-3-27B
def test_gemma_attention_scale_follows_llama_cpp(arch, layers, hidden, heads, scalar):
    """The files hold no query_pre_attn_scalar: key_length, except the 27B models' hidden / heads
    (their HF configs' value, and llama.cpp's LLM_TYPE_27B rule)."""
    from kvserve.model.gguf_families import gguf_family_fields

    meta = {"attention.key_length": 128 if layers in (46, 62) else 256, "embedding_length": hidden,
            "attention.head_count": heads, "attention.sliding_window": 4096, "context_length": 8192}
    kw = gguf_family_fields(arch, lambda k, d=None: meta.get(k, d), set(), layers)
    assert kw["query_pre_attn_scalar"] == scalar
