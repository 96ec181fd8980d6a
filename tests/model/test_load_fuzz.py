"""Model files that are broken in every way a mutation corpus can think of: each load ends in a
`kvserve.errors` error (one line), never another exception, a hang or a memory peak far beyond
the file. Corpora are built here, from files the tests make (a tiny GGUF, a tiny Hugging Face
directory) and from the real SmolLM2 GGUF (truncations of its header). A hang is caught by an
alarm per case (a generous bound, not a timing assertion).
"""

from __future__ import annotations

import json
import signal
import tracemalloc

import torch
from gguf import GGUFReader
from gguf_mutations import header_mutations, truncations
from ggufmaker import make_tiny_llama_gguf

from kvserve.errors import KVServeError
from kvserve.model.loader import load_model
from kvserve.model.registry import resolve

HANG_S = 60


def expect_clean_failure(path, size: int, label: str) -> None:
    def hang(*_):
        raise AssertionError(f"{label}: still loading after {HANG_S} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(HANG_S)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    try:
        load_model(str(path))
    except KVServeError as e:
        assert "\n" not in e.message, (label, e.message)
    else:
        raise AssertionError(f"{label}: loaded without an error")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        peak = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
    assert peak <= 2 * size + (16 << 20), f"{label}: {peak} bytes allocated for a {size}-byte file"


def test_mutated_tiny_gguf(tmp_path):
    base = make_tiny_llama_gguf(tmp_path / "tiny.gguf", qtype="Q8_0")
    load_model(str(base))                                   # the unmutated file loads
    data = base.read_bytes()
    header_end = min(t.data_offset for t in GGUFReader(base).tensors)
    cases = header_mutations(base) + truncations(data, header_end)
    assert len(cases) > 150
    for label, blob in cases:
        path = tmp_path / "mutant.gguf"
        path.write_bytes(blob)
        expect_clean_failure(path, len(blob), label)


def test_truncated_real_model(tmp_path):
    """The real model cut inside its header (tokenizer metadata, tensor infos) and just after it."""
    src = resolve(None).path
    header_end = min(t.data_offset for t in GGUFReader(src).tensors)   # gguf's reader: a few seconds
    with open(src, "rb") as f:
        head = f.read(header_end + 4096)
    for label, blob in truncations(head, header_end, count=16):
        path = tmp_path / "cut.gguf"
        path.write_bytes(blob)
        expect_clean_failure(path, len(blob), f"SmolLM2 {label}")


def make_hf_dir(path, tiny_gguf):
    """A tiny Hugging Face directory: config.json, model.safetensors, tokenizer.json."""
    from safetensors.torch import save_file

    loaded = load_model(str(tiny_gguf), weight_format="fp32")
    cfg = loaded.config
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    loaded.tokenizer.hf.save(str(path / "tokenizer.json"))
    h, d, kv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.intermediate_size
    w = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h), "model.norm.weight": torch.ones(h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": torch.randn(cfg.num_attention_heads * d, h),
                  p + "self_attn.k_proj.weight": torch.randn(kv * d, h),
                  p + "self_attn.v_proj.weight": torch.randn(kv * d, h),
                  p + "self_attn.o_proj.weight": torch.randn(h, cfg.num_attention_heads * d),
                  p + "mlp.gate_proj.weight": torch.randn(inter, h), p + "mlp.up_proj.weight": torch.randn(inter, h),
                  p + "mlp.down_proj.weight": torch.randn(h, inter),
                  p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h)})
    save_file(w, str(path / "model.safetensors"))
    return path


def test_mutated_hf_directory(tmp_path):
    hf = make_hf_dir(tmp_path / "hf", make_tiny_llama_gguf(tmp_path / "tiny.gguf"))
    load_model(str(hf))                                     # the unmutated directory loads
    config = json.loads((hf / "config.json").read_text())
    weights = (hf / "model.safetensors").read_bytes()
    tokenizer = (hf / "tokenizer.json").read_bytes()
    cases: list[tuple[str, str, bytes | None]] = [
        ("config not JSON", "config.json", b"{not json"), ("config a list", "config.json", b"[1, 2]"),
        ("config empty", "config.json", b""), ("config bad UTF-8", "config.json", b"\xff\xfe{}"),
        ("weights missing", "model.safetensors", None), ("tokenizer missing", "tokenizer.json", None),
        ("tokenizer garbage", "tokenizer.json", b"{\"model\": 5}"), ("tokenizer empty", "tokenizer.json", b""),
        ("tokenizer truncated", "tokenizer.json", tokenizer[: len(tokenizer) // 2]),
        ("safetensors header length huge", "model.safetensors", (2**62).to_bytes(8, "little") + weights[8:]),
        ("safetensors header garbage", "model.safetensors", weights[:8] + b"x" * 64 + weights[72:]),
    ]
    for cut in (0, 4, 8, 100, len(weights) // 2, len(weights) - 1):
        cases.append((f"safetensors truncated at {cut}", "model.safetensors", weights[:cut]))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta"):
        for bad in (0, -1, "big", 2**40, 1.5, None, [], {"a": 1}):
            if (key in ("rms_norm_eps", "rope_theta") and bad == 1.5 or   # legal values
                    key == "num_key_value_heads" and bad in (None, []) or
                    key == "rope_theta" and bad in (2**40, None)):
                continue
            cases.append((f"config {key}={bad!r}", "config.json", json.dumps({**config, key: bad}).encode()))
    cases.append(("config of an unknown architecture", "config.json",
                  json.dumps({**config, "architectures": [{"a": 1}], "model_type": ["x"]}).encode()))
    cases.append(("config hidden_size doubled", "config.json",
                  json.dumps({**config, "hidden_size": config["hidden_size"] * 2}).encode()))
    originals = {"config.json": json.dumps(config).encode(), "model.safetensors": weights, "tokenizer.json": tokenizer}
    for label, name, blob in cases:
        for fname, content in originals.items():
            (hf / fname).write_bytes(content)
        if blob is None:
            (hf / name).unlink()
        else:
            (hf / name).write_bytes(blob)
        expect_clean_failure(hf, len(weights) + 4 * len(tokenizer), label)
