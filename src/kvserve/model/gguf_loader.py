"""Read a GGUF file: validate it, translate its metadata to a ModelConfig, and hand its tensors
over under Hugging Face names, block quants still packed.

GGUF converters permute the rows of Q and K of Llama-style models so llama.cpp can apply RoPE
to adjacent pairs; we undo that permutation (row reordering, exact on packed rows) to get back
the rotate-half layout the model file uses.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from kvserve.errors import ModelLoadError, ModelNotFound
from kvserve.model.config import ModelConfig
from kvserve.model.gguf_families import (
    ARCHITECTURES,
    LAYER_NAMES,
    expert_weights,
    fix_weights,
    gguf_family_fields,
)
from kvserve.model.linear import WeightSource
from kvserve.model.rope import rope_scaling_from_gguf
from kvserve.tokenizer.tokenizer import gguf_field as field

GGUF_MAGIC = b"GGUF"
SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    **LAYER_NAMES,
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight", "rope_freqs.weight": "rope_freqs"}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def open_gguf(path: str | os.PathLike):
    """Open and structurally validate a GGUF file; returns a GGUFFile (gguf_file.py: memory-mapped,
    tensors as views of the mapping, GGUFReader's interface)."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFound(f"model file not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    from kvserve.model.gguf_file import GGUFFile

    try:
        reader = GGUFFile(path)      # one bounds-checked pass over the header (gguf_check.py)
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - what the checks leave (a key that is not UTF-8) is corrupt too
        raise ModelLoadError(f"{path} is truncated or corrupt: the GGUF header cannot be read ({e})") from None
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}; "
                                 f"supported: {', '.join(sorted(SUPPORTED_TYPES))}")
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelLoadError(f"{path} is truncated or corrupt: tensor {t.name} ({t.n_bytes} bytes at "
                                 f"offset {t.data_offset}) extends beyond the end of the file ({size} bytes)")
    return reader


def config_from_gguf(reader, name: str = "") -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} in GGUF file: kvserve runs "
                             f"{', '.join(ARCHITECTURES)}")

    def req(key: str):
        v = field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(f"GGUF metadata is missing {arch}.{key}")
        return v

    _check_metadata(reader, arch)
    if field(reader, f"{arch}.vocab_size") is None and "tokenizer.ggml.tokens" not in reader.fields:
        raise ModelLoadError("GGUF metadata has neither a vocab_size nor tokenizer.ggml.tokens")
    n_vocab = field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    n_head = int(req("attention.head_count"))
    hidden = int(req("embedding_length"))
    names = {t.name for t in reader.tensors}
    rope_scaling = rope_scaling_from_gguf(lambda k, d=None: field(reader, f"{arch}.{k}", d))
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    n_layers = int(req("block_count"))
    family = gguf_family_fields(arch, lambda k, d=None: field(reader, f"{arch}.{k}", d), names, n_layers)
    if family.get("num_experts") and "blk.0.ffn_gate_exps.weight" in names:   # the experts' FFN width
        inter = int(next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_exps.weight").shape[1])
        family["moe_intermediate_size"] = inter
    elif "blk.0.ffn_up.weight" in names and "blk.0.ffn_gate.weight" not in names:    # Phi-3: fused gate/up
        family["intermediate_size"] = int(next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight").shape[1]) // 2
    if "intermediate_size" not in family:   # MoE files may carry only the experts' width
        family["intermediate_size"] = int(field(reader, f"{arch}.feed_forward_length", 0) or 0
                                          ) if family.get("num_experts") else int(req("feed_forward_length"))
    return ModelConfig(
        vocab_size=int(n_vocab), hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_head,
        num_key_value_heads=int(field(reader, f"{arch}.attention.head_count_kv", n_head)),
        head_dim=int(field(reader, f"{arch}.attention.key_length", hidden // n_head)),
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
        max_position_embeddings=int(field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names, attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"), eos_token_id=eos,
        name=name or str(field(reader, "general.name", "")), **family)


# metadata key (after "<arch>.") -> (kind, smallest, largest): a value of the wrong type or out of
# range is a corrupt file, not a model with 0 layers or a division by zero later
_METADATA = {
    "vocab_size": (int, 1, 1 << 24), "embedding_length": (int, 1, 1 << 20), "feed_forward_length": (int, 1, 1 << 22),
    "block_count": (int, 1, 4096), "attention.head_count": (int, 1, 4096), "attention.head_count_kv": (int, 1, 4096),
    "attention.key_length": (int, 1, 1 << 16), "context_length": (int, 1, 1 << 24),
    "attention.layer_norm_rms_epsilon": (float, 1e-12, 1.0), "rope.freq_base": (float, 1.0, 1e12),
    "rope.scaling.factor": (float, 1e-3, 1e6),
}


def _check_metadata(reader, arch: str) -> None:
    for key, (kind, lo, hi) in _METADATA.items():
        v = field(reader, f"{arch}.{key}")
        if v is None:
            continue
        ok_type = isinstance(v, int) and not isinstance(v, bool) if kind is int else isinstance(v, (int, float))
        if not ok_type or not lo <= v <= hi:
            raise ModelLoadError(f"GGUF metadata {arch}.{key} is {v!r}: expected {kind.__name__} in [{lo}, {hi}]")
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        v = field(reader, key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ModelLoadError(f"GGUF metadata {key} is {v!r}: expected a token id")
    heads, kv = field(reader, f"{arch}.attention.head_count"), field(reader, f"{arch}.attention.head_count_kv")
    if heads and kv and heads % kv:
        raise ModelLoadError(f"GGUF metadata: {heads} attention heads are not a multiple of {kv} key/value heads")
    hidden = field(reader, f"{arch}.embedding_length")
    if heads and hidden and field(reader, f"{arch}.attention.key_length") is None and hidden % heads:
        raise ModelLoadError(f"GGUF metadata: embedding_length {hidden} is not a multiple of {heads} heads")


def _unpermute_order(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's converter permute() for a Q or K weight."""
    idx = torch.arange(n_rows)
    return idx.reshape(n_head, n_rows // n_head // 2, 2).transpose(1, 2).reshape(-1)


def weights_from_gguf(reader, cfg: ModelConfig, *, cached: bool = False) -> dict[str, WeightSource | torch.Tensor]:
    """HF-named weights of `reader`; block quants as views of the mapped file (no copy).
    cached: the packed layers come from the pack cache (kernels/pack_cache.py), so tensors that
    will become packed layers are given as empty rows (shape [rows, 0]: nothing is read or
    copied for them, not even to undo the Q/K permutation, which the cached rows already have)."""
    from gguf.quants import dequantize

    from kvserve.model.kernels.gguf_linear import supports

    stub = _packed_tensors(reader) if cached else set()
    out: dict[str, WeightSource | torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        qt = t.tensor_type
        if len(shape) == 3:     # stacked experts
            out.update(expert_weights(name, shape, t.data, qt))
            continue
        if len(shape) == 1 or name == "rope_freqs":
            out[name] = torch.from_numpy(np.array(dequantize(t.data, qt), dtype=np.float32).reshape(-1))
            continue
        if qt.name in ("F32", "F16"):
            src = WeightSource(shape, tensor=torch.from_numpy(np.array(t.data)).reshape(shape))
        else:
            raw = t.data[:, :0] if t.name in stub and supports(qt) else t.data
            src = WeightSource(shape, raw=raw, qtype=qt)
        out[name] = src
    fix_weights(cfg, out)
    _check_shapes(out, cfg)
    if "rope_freqs" in out:
        cfg.rope_scaling = {"rope_type": "freq_factors", "factors": out.pop("rope_freqs").tolist()}
    if cfg.architecture in ("llama", "mistral", "mixtral"):
        for i in range(cfg.num_hidden_layers):
            for proj, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads)):
                for suffix in ("weight", "bias"):
                    key = f"model.layers.{i}.self_attn.{proj}_proj.{suffix}"
                    if key not in out:
                        continue
                    v = out[key]
                    n = v.shape[0]
                    order = _unpermute_order(n, heads)
                    out[key] = v[order] if isinstance(v, torch.Tensor) else v.permute_rows(order)
    return out


def _packed_tensors(reader) -> set[str]:
    """Names of the 2-D tensors whose projection is built packed from their rows alone: fused
    groups (q/k/v, gate/up) only when every member has the same type or every member's type is
    packed (then each keeps its type, kernels/fused_linear.py); else they are
    concatenated dequantized, which needs the bytes."""
    from kvserve.model.kernels.gguf_linear import supports

    groups: dict[str, list] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(t.shape) != 2:
            continue
        kind = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gu", "ffn_up": "gu"}.get(
            parts[2] if len(parts) == 4 and parts[0] == "blk" else "")
        groups.setdefault(f"{parts[1]}.{kind}" if kind else t.name, []).append(t)
    return {t.name for g in groups.values()
            if len({t.tensor_type for t in g}) == 1 or all(supports(t.tensor_type) for t in g) for t in g}


def _check_shapes(w: dict, cfg: ModelConfig) -> None:
    h, d = cfg.hidden_size, cfg.head_dim
    want = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        want.update({
            p + "self_attn.q_proj.weight": (cfg.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if p + "self_attn.qkv_proj.weight" in w:      # Phi-3: fused q/k/v and gate/up
            for n in "qkv":
                want.pop(p + f"self_attn.{n}_proj.weight")
            want[p + "self_attn.qkv_proj.weight"] = (d * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads), h)
        if p + "mlp.gate_proj.weight" not in w:       # fused gate/up (Phi-3) or experts (checked when built)
            for n in ("gate", "up", "down"):
                want.pop(p + f"mlp.{n}_proj.weight")
    for name, shape in want.items():
        if name not in w:
            raise ModelLoadError(f"model file is missing tensor {name}")
        got = tuple(w[name].shape)
        if got != shape:
            raise ModelLoadError(f"tensor {name} has shape {got}, expected {shape} from the model config")
