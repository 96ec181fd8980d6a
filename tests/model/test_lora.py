"""LoRA adapters: our logits under a PEFT adapter equal `peft`'s on transformers (fp32, 1e-4), in a
dense forward and in paged steps mixing adapters and the base; adapters for another base fail at
load with one line."""

import json

import pytest
import torch

from kvserve.errors import InvalidRequest, ModelNotFound
from kvserve.model.attention import AttentionMetadata
from kvserve.model.decoder import DecoderLM
from kvserve.model.hf_loader import config_from_dir, weights_from_dir
from kvserve.model.lora import LoRABatch, load_adapter

TOL = 1e-4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf(vocab=320):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _adapter(hf, path, targets, r, seed):
    """A random (B != 0) PEFT adapter saved to `path`; returns the peft model."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    pm = get_peft_model(copy.deepcopy(hf), LoraConfig(r=r, lora_alpha=2 * r + 1, target_modules=targets,
                                                      init_lora_weights=False, lora_dropout=0.0))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.mul_(0.5)
    pm.save_pretrained(path)
    return pm.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    hf = _hf()
    hf.save_pretrained(d / "base")
    cfg = config_from_dir(d / "base")
    ours = DecoderLM.from_weights(cfg, weights_from_dir(d / "base", cfg), "fp32").eval()
    peft_models = {"all": _adapter(hf, d / "all", ALL, 4, 1), "qv": _adapter(hf, d / "qv", ["q_proj", "v_proj"], 8, 2),
                   "mlp": _adapter(hf, d / "mlp", ["gate_proj", "down_proj"], 2, 3)}
    adapters = {k: load_adapter(d / k, cfg, k) for k in peft_models}
    return d, hf, ours, peft_models, adapters


def test_dense_logits_equal_peft(setup):
    _, hf, ours, peft_models, adapters = setup
    ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = ours.compute_logits(ours(ids))
        assert (base - hf(ids).logits).abs().max() < TOL
        for k, pm in peft_models.items():
            ref = pm(ids).logits
            assert (ref - base).abs().max() > 1e-2          # the adapter changes the output
            got = ours.compute_logits(ours(ids, lora=LoRABatch([(adapters[k], None)])))
            assert (got - ref).abs().max() < TOL, k


def test_paged_mixed_batch_equals_peft_and_alone(setup):
    """One paged step holding a prompt per adapter and one for the base: each row's logits equal
    peft's and the row computed alone."""
    _, hf, ours, peft_models, adapters = setup
    cfg = ours.config
    g = torch.Generator().manual_seed(3)
    seqs = [(k, torch.randint(0, 320, (n,), generator=g)) for k, n in (("all", 9), (None, 5), ("qv", 12), ("mlp", 4))]
    bs = 4

    def run(items):
        kv = [torch.zeros(2, 32, bs, cfg.num_key_value_heads, cfg.head_dim) for _ in range(cfg.num_hidden_layers)]
        ids, pos, qlens, tables, rows, nxt = [], [], [], [], [], 0
        for k, s in items:
            nb = (len(s) + bs - 1) // bs
            tables.append(list(range(nxt, nxt + nb)))
            nxt += nb
            rows.append((None if k is None else adapters[k], len(ids), len(s)))
            ids += s.tolist()
            pos += range(len(s))
            qlens.append(len(s))
        meta = AttentionMetadata.build(qlens, qlens, tables, bs)
        from kvserve.engine.lora import LoRAManager
        with torch.inference_mode():
            h = ours(torch.tensor(ids), torch.tensor(pos), meta, kv, lora=LoRAManager.batch(rows, len(ids)))
            logits = ours.compute_logits(h)
        return [logits[r0:r0 + n] for _, r0, n in rows]

    mixed = run(seqs)
    for (k, s), got in zip(seqs, mixed):
        with torch.no_grad():
            ref = (hf if k is None else peft_models[k])(s[None]).logits[0]
        assert (got - ref).abs().max() < TOL, k
        # fp32 base weights run on MKL, whose per-row bits vary with the batch: the bitwise check
        # is the engine's, on the int8 kernels (tests/engine/test_lora_engine.py)
        assert (run([(k, s)])[0] - got).abs().max() < 1e-5, k


def test_bad_adapters_fail_at_load(setup, tmp_path):
    import transformers

    _, _, ours, _, _ = setup
    cfg = ours.config
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    _adapter(other, tmp_path / "small", ["q_proj"], 4, 0)
    with pytest.raises(InvalidRequest, match="another base"):
        load_adapter(tmp_path / "small", cfg)
    from peft import LoraConfig, get_peft_model
    pm = get_peft_model(_hf(vocab=400), LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    pm.save_pretrained(tmp_path / "vocab")
    with pytest.raises(InvalidRequest, match="modules_to_save"):
        load_adapter(tmp_path / "vocab", cfg)
    conf = json.loads((tmp_path / "vocab" / "adapter_config.json").read_text())
    conf["modules_to_save"] = None
    (tmp_path / "vocab" / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(InvalidRequest, match="vocabulary has 400"):
        load_adapter(tmp_path / "vocab", cfg)
    with pytest.raises(ModelNotFound):
        load_adapter(tmp_path / "nowhere", cfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidRequest, match="not a PEFT adapter"):
        load_adapter(tmp_path / "empty", cfg)


def test_c_whole_stack_forward_adds_lora_like_the_layers(tmp_path):
    """The default model's C whole-stack forward with LoRA rows (kvs_forward_lora) changes the logits
    as the per-layer path (LoRABatch.add) does, in a step mixing two adapters and the base."""
    from kvserve.engine.lora import LoRAManager
    from kvserve.model.loader import load_model
    from kvserve.train.lora import random_adapter

    lm = load_model(None)
    model, cfg = lm.model, lm.config
    ops = model.layer_ops()
    if not getattr(ops, "max_tokens", 0):
        pytest.skip("no C whole-stack forward on this machine")
    adapters = [load_adapter(random_adapter(tmp_path / f"a{i}", cfg, i, rank=4 + 4 * i, std=0.08,
                                            targets=None if i == 0 else ["q_proj", "o_proj", "down_proj"]),
                             cfg, f"a{i}") for i in range(2)]
    ids = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    bs, n = 16, len(ids)

    def run(fused: bool, slots):
        kv = [torch.zeros(2, 8, bs, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float16)
              for _ in range(cfg.num_hidden_layers)]
        meta = AttentionMetadata.build([n] * 3, [n] * 3, [[0], [1], [2]], bs)
        saved = ops.max_tokens
        ops.max_tokens = saved if fused else 0
        lora = LoRAManager.batch([(a, i * n, n) for i, a in enumerate(slots)], 3 * n)
        try:
            with torch.inference_mode():
                return model.compute_logits(model(torch.tensor(ids * 3), torch.arange(n).repeat(3), meta, kv,
                                                  lora=lora))
        finally:
            ops.max_tokens = saved

    slots = [adapters[0], None, adapters[1]]
    c, py = run(True, slots), run(False, slots)
    base = run(True, [None, None, None])
    assert torch.equal(c[n:2 * n], base[n:2 * n])            # the base row is the base's
    for k in (0, 2):
        # Both paths quantize activations to int8 per block: a last-bit difference in where the delta
        # joins can flip a rounding, which the 30 layers amplify, so compare the adapter's effect as
        # a whole (a missing or misplaced term gives an error of the order of the effect itself).
        rows = slice(k * n, (k + 1) * n)
        effect_c, effect_py = c[rows] - base[rows], py[rows] - base[rows]
        assert effect_py.norm() > 10
        assert (effect_c - effect_py).norm() < 0.15 * effect_py.norm()
