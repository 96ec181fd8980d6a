"""Every model family against transformers, on tiny random checkpoints built from configs that keep
the family's real feature flags (families_maker.py), loaded both from safetensors and from a GGUF
written with llama.cpp's names and keys (families_gguf.py):

* fp32 logits over a 64-token prompt within 1e-4 of transformers, dense and through the paged
  cache (prefill in chunks, then one token per step);
* 32 greedy tokens equal to transformers' generate, through the batched engine: a batch of 4,
  prefill in one step and in chunks, and a prompt served again from the prefix cache;
* with a sliding window on every layer (Mistral), the KV blocks a sequence holds stay bounded
  by the window while it grows past it; with local layers beside global ones (Gemma), the local
  layers' own pool does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from families_gguf import write_gguf
from families_maker import FAMILIES, make_hf_model
from ggufmaker import CHAT_TEMPLATE

from kvserve import LLM, SamplingParams
from kvserve.errors import ModelLoadError
from kvserve.model.attention import AttentionMetadata
from kvserve.model.decoder import DecoderLM
from kvserve.model.gguf_loader import config_from_gguf, open_gguf, weights_from_gguf
from kvserve.model.hf_loader import config_from_dir, weights_from_dir
from kvserve.tokenizer import Tokenizer

TOL = 1e-4
VOCAB = 262
PROMPT_LEN = 64
NEW_TOKENS = 32
EOS = 2   # the GGUF's eos_token_id


class Checkpoint:
    def __init__(self, family: str, root: Path):
        self.family = family
        self.hf = make_hf_model(family)
        self.dir = root / family
        self.hf.save_pretrained(self.dir)
        self.gguf = write_gguf(self.dir, family, root / f"{family}.gguf")
        # The safetensors directory gets the same tokenizer, as tokenizer.json + tokenizer_config.json.
        Tokenizer.from_gguf(open_gguf(self.gguf)).hf.save(str(self.dir / "tokenizer.json"))
        (self.dir / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))

    def ours(self, source: str) -> DecoderLM:
        if source == "safetensors":
            cfg = config_from_dir(self.dir)
            w = weights_from_dir(self.dir, cfg)
        else:
            reader = open_gguf(self.gguf)
            cfg = config_from_gguf(reader)
            w = weights_from_gguf(reader, cfg)
        return DecoderLM.from_weights(cfg, w, "fp32").eval()

    def greedy(self, prompts: list[list[int]], suppress: list[int], n: int = NEW_TOKENS) -> list[list[int]]:
        """transformers' greedy tokens; `suppress`: the end tokens our sampler masks for ignore_eos."""
        out = []
        with torch.no_grad():
            for p in prompts:
                ids = self.hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                       pad_token_id=0, eos_token_id=None, suppress_tokens=suppress)
                out.append(ids[0, len(p):].tolist())
        return out


_CACHE: dict[str, Checkpoint] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("families")


def checkpoint(family: str, root: Path) -> Checkpoint:
    if family not in _CACHE:
        _CACHE[family] = Checkpoint(family, root)
    return _CACHE[family]


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def paged_logits(model: DecoderLM, ids: list[int], chunk: int, block_size: int = 4) -> torch.Tensor:
    """Prefill in chunks of `chunk` tokens, then one token per step, blocks out of order."""
    cfg = model.config
    n_blocks = (len(ids) + block_size - 1) // block_size
    table = list(range(n_blocks))[::-1]
    kv = [torch.zeros(2, n_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
          for _ in range(cfg.num_hidden_layers)]
    ends = list(range(chunk, len(ids) // 2, chunk)) + list(range(len(ids) // 2, len(ids) + 1))
    out, start = [], 0
    for end in ends:
        meta = AttentionMetadata.build([end - start], [end], [table], block_size)
        with torch.no_grad():
            out.append(model.compute_logits(model(torch.tensor(ids[start:end]), torch.arange(start, end), meta, kv)))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(family, source, root):
    ck = checkpoint(family, root)
    ours = ck.ours(source)
    ids = prompts(1)[0]
    with torch.no_grad():
        ref = ck.hf(torch.tensor([ids])).logits[0]
        dense = ours.compute_logits(ours(torch.tensor([ids])))[0]
    assert (dense - ref).abs().max().item() <= TOL
    assert (paged_logits(ours, ids, chunk=7) - ref).abs().max().item() <= TOL
    assert ours.config.llama_shaped == (family == "phi3")   # the new features keep off the C fused path


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_through_the_engine(family, root):
    ck = checkpoint(family, root)
    ps = prompts(4, seed=2)
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    wants: dict[tuple[int, ...], list[list[int]]] = {}
    # the whole batch's prompts in one step from the GGUF; in chunks of 16 from the safetensors
    for source, budget in ((ck.gguf, 512), (ck.dir, 16)):
        llm = LLM(str(source), kv_cache_memory="8MiB", kv_cache_dtype="fp32", block_size=4,
                  max_num_batched_tokens=budget)
        eos = tuple(llm.get_tokenizer().eos_token_ids)
        assert EOS in eos
        want = wants.setdefault(eos, ck.greedy(ps, list(eos)))
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, budget
        again = llm.generate([{"prompt_token_ids": ps[0]}], sp, use_tqdm=False)[0]
        assert again.num_cached_tokens >= PROMPT_LEN - 4           # served from the prefix cache
        assert again.outputs[0].token_ids == want[0]


def test_sliding_window_bounds_kv_blocks(root):
    ck = checkpoint("mistral_swa", root)
    window, bs = ck.hf.config.sliding_window, 4
    llm = LLM(str(ck.gguf), kv_cache_memory="8MiB", kv_cache_dtype="fp32", block_size=bs,
              max_num_batched_tokens=16)
    kv = llm.engine.core.kv
    assert kv.sliding_window == window
    ps = prompts(2, seed=3)
    llm.engine.add_request("a", {"prompt_token_ids": ps[0]}, SamplingParams(temperature=0, max_tokens=64,
                                                                          ignore_eos=True))
    held, table_len, tokens = [], 0, []
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            tokens = o.outputs[0].token_ids
        if "a" in kv.req_blocks:
            held.append(kv.num_held_blocks("a"))
            table_len = len(kv.block_ids("a"))
    assert table_len >= (PROMPT_LEN + 60) // bs                  # the sequence grew to ~32 blocks ...
    assert max(held) <= (window + 16) // bs + 2                  # ... holding at most window + one chunk
    assert kv.num_used_blocks == 0
    # Past the window and with blocks released, the tokens are still transformers' (window applied).
    assert tokens == ck.greedy([ps[0]], llm.get_tokenizer().eos_token_ids, n=64)[0]
    # A prompt sharing the first blocks still hits the prefix cache (released blocks keep their hash).
    out = llm.generate([{"prompt_token_ids": ps[0][:40] + ps[1][:24]}],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.num_cached_tokens >= 36


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_local_layers_hold_only_the_window(family, root):
    """Gemma (local layers beside global ones): the sliding layers have their own pool and tables
    (engine/kv_hybrid.py), whose blocks a sequence holds stay bounded by the window while its
    global layers' table grows; tokens stay transformers'; a shared prefix still hits both pools."""
    from kvserve.engine.kv_hybrid import HybridKVCacheManager

    ck = checkpoint(family, root)
    window, bs = ck.hf.config.sliding_window, 4
    llm = LLM(str(ck.gguf), kv_cache_memory="8MiB", kv_cache_dtype="fp32", block_size=bs,
              max_num_batched_tokens=16, max_num_seqs=4)
    core = llm.engine.core
    kv = core.kv
    assert isinstance(kv, HybridKVCacheManager) and kv.local.sliding_window == window
    cfg = core.runner.model.config
    local_layers = [i for i in range(cfg.num_hidden_layers) if cfg.window_of(i)]
    assert 0 < len(local_layers) < cfg.num_hidden_layers
    # the local pool is sized by the window (4 sequences), its memory saved goes to the global pool
    assert kv.local.num_blocks < kv.num_blocks
    assert all(core.runner.kv_caches[i].shape[1] == kv.local.num_blocks for i in local_layers)
    ps = prompts(2, seed=3)
    llm.engine.add_request("a", {"prompt_token_ids": ps[0]}, SamplingParams(temperature=0, max_tokens=64,
                                                                          ignore_eos=True))
    held_local, held_full, tokens = [], [], []
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            tokens = o.outputs[0].token_ids
        if "a" in kv.req_blocks:
            held_local.append(kv.local.num_held_blocks("a"))
            held_full.append(kv.full.num_held_blocks("a"))
            assert len(kv.local_block_ids("a")) == len(kv.block_ids("a"))
    assert max(held_full) >= (PROMPT_LEN + 60) // bs             # the global layers hold it all ...
    assert max(held_local) <= (window + 16) // bs + 2            # ... the local ones the window + a chunk
    assert kv.num_used_blocks == 0 and kv.local.num_used_blocks == 0
    assert tokens == ck.greedy([ps[0]], llm.get_tokenizer().eos_token_ids, n=64)[0]
    # A prompt sharing the first 40 tokens: the local blocks inside the window of the hit are
    # still cached (released, not evicted), so both pools hit and the answer is unchanged.
    p = ps[0][:40] + ps[1][:24]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 36
    assert out.outputs[0].token_ids == ck.greedy([p], llm.get_tokenizer().eos_token_ids, n=8)[0]


def test_unsupported_architecture_is_one_line(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"],
                                                      "model_type": "falcon"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture .*Falcon") as e:
        config_from_dir(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_quantized_experts_are_batch_invariant_and_counted(family, root):
    """Q8_0 experts run packed on the int8 kernels (the same Linear as every projection); a request's
    logprobs are the same alone and in a batch of 4; each request's routed tokens are counted."""
    from kvserve.model.kernels.gguf_linear import GGUFQuantLinear

    ck = checkpoint(family, root)
    path = write_gguf(ck.dir, family, root / f"{family}-q8_0.gguf", qtype="Q8_0")
    llm = LLM(str(path), kv_cache_memory="8MiB", kv_cache_dtype="fp32", block_size=4, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    cfg = model.config
    assert all(isinstance(e.gate_up_proj, GGUFQuantLinear) and isinstance(e.down_proj, GGUFQuantLinear)
               for layer in model.layers for e in layer.mlp.experts)
    ps = prompts(4, seed=5)
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)

    def run(batch):
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs],
                 o.metrics.expert_tokens)
                for o in llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)]

    alone = [run([p])[0] for p in ps]
    together = run(ps)
    assert [a[:2] for a in alone] == [t[:2] for t in together]       # bit-equal logprobs
    rows = PROMPT_LEN + 8 - 1                                        # tokens each request fed the model
    for _, _, experts in together:
        assert len(experts) == cfg.num_experts
        assert sum(experts) == rows * cfg.num_hidden_layers * cfg.num_experts_per_tok
    assert [t[2] for t in together] == [a[2] for a in alone]
    stats = llm.stats()["moe_expert_tokens"]
    assert len(stats) == cfg.num_hidden_layers
    assert sum(map(sum, stats)) == 2 * 4 * rows * cfg.num_hidden_layers * cfg.num_experts_per_tok


@pytest.mark.parametrize("change,match", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"partial_rotary_factor": 0.5}, "partial rotary"),
])
def test_inconsistent_family_configs_are_one_line_errors(tmp_path, change, match):
    import json

    d = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32, **change}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ModelLoadError, match=match) as e:
        config_from_dir(tmp_path)
    assert "\n" not in str(e.value)


def test_phi3_longrope_gguf_is_refused(root, tmp_path):
    import gguf

    ck = checkpoint("phi3", root)
    reader = gguf.GGUFReader(ck.gguf)
    w = gguf.GGUFWriter(str(tmp_path / "long.gguf"), "phi3")
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY
                        else None)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data.copy())
    w.add_tensor("rope_factors_long.weight", torch.ones(8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="phi3.*LongRoPE"):
        config_from_gguf(open_gguf(tmp_path / "long.gguf"))
