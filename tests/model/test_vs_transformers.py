"""Our model's logits equal transformers' on tiny random checkpoints, in fp32: a dense forward
(prefill) and a paged forward fed one token at a time (decode), with blocks out of order."""

import pytest
import torch

from kvserve.model.attention import AttentionMetadata
from kvserve.model.decoder import DecoderLM
from kvserve.model.hf_loader import config_from_dir, weights_from_dir

TOL = 1e-4


def _hf_model(kind: str, tied: bool, kv_heads: int, rope_scaling=None):
    import transformers

    common = {"vocab_size": 320, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
              "num_attention_heads": 8, "num_key_value_heads": kv_heads, "max_position_embeddings": 256,
              "tie_word_embeddings": tied, "rms_norm_eps": 1e-5}
    if kind == "llama":
        cfg = transformers.LlamaConfig(rope_theta=10000.0, rope_scaling=rope_scaling, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(rope_theta=1e6, sliding_window=None, **common)
        model = transformers.MistralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(rope_theta=1e6, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():   # default init leaves biases at zero and norms at one: perturb them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


CASES = [
    ("llama", False, 2, None),                       # GQA, untied
    ("llama", True, 8, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ("llama", True, 1, None),                        # MQA, tied
    ("mistral", False, 2, None),
    ("qwen2", True, 2, None),                        # q/k/v bias, tied
    ("qwen2", False, 4, None),
]


def _load_ours(tmp_path, hf) -> DecoderLM:
    hf.save_pretrained(tmp_path)
    cfg = config_from_dir(tmp_path)
    return DecoderLM.from_weights(cfg, weights_from_dir(tmp_path, cfg), "fp32").eval()


def _paged_logits(model: DecoderLM, ids: list[int], prefill: int, block_size: int = 4) -> torch.Tensor:
    """Prefill `prefill` tokens in one step, then one token per step; logits of every position."""
    cfg = model.config
    n_blocks = (len(ids) + block_size - 1) // block_size
    table = list(range(n_blocks))[::-1]               # blocks deliberately out of order
    kv = [torch.zeros(2, n_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
          for _ in range(cfg.num_hidden_layers)]
    out = []
    start = 0
    for end in [prefill] + list(range(prefill + 1, len(ids) + 1)):
        meta = AttentionMetadata.build([end - start], [end], [table], block_size)
        h = model(torch.tensor(ids[start:end]), torch.arange(start, end), meta, kv)
        out.append(model.compute_logits(h))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("kind,tied,kv_heads,rope_scaling", CASES)
def test_logits_match_transformers(tmp_path, kind, tied, kv_heads, rope_scaling):
    hf = _hf_model(kind, tied, kv_heads, rope_scaling)
    ours = _load_ours(tmp_path, hf)
    g = torch.Generator().manual_seed(1)
    for length in (5, 23, 70):
        ids = torch.randint(0, 320, (1, length), generator=g)
        with torch.no_grad():
            ref = hf(ids).logits[0]
            dense = ours.compute_logits(ours(ids))[0]
            paged = _paged_logits(ours, ids[0].tolist(), prefill=max(1, length // 3))
        assert (dense - ref).abs().max().item() <= TOL, (kind, length)
        assert (paged - ref).abs().max().item() <= TOL, (kind, length)


def test_batched_dense_forward_matches_single(tmp_path):
    hf = _hf_model("llama", False, 2)
    ours = _load_ours(tmp_path, hf)
    ids = torch.randint(0, 320, (3, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        batched = ours.compute_logits(ours(ids))
        ref = hf(ids).logits
    assert (batched - ref).abs().max().item() <= TOL
