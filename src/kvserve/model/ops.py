"""The math between a decoder layer's projections, behind one small interface.

A decoder layer (decoder.py) is written once, as calls to its projections and to an ops object:

    h = ops.rms_norm(x, input_layernorm);  qkv = qkv_proj(h)
    o = ops.attention(qkv, layer, step, kv_cache)       # RoPE, KV-cache write, attention
    x = x + o_proj(o);  h = ops.rms_norm(x, post_attention_layernorm)
    x = x + down_proj(ops.silu_mul(gate_up_proj(h)))

`TorchOps` below is that math in PyTorch: the reference, the path under autograd and on any
device. The CPU kernels' `CpuOps` (kernels/cpu_ops.py) implements the same methods in C and may
also run a whole small step in one call (`forward_stack`). `prepare` turns a step's positions and
attention metadata into what every layer shares (a `Step`), once per forward; an ops object that
cannot serve the step returns None and the model falls back to its TorchOps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvserve.model.attention import AttentionMetadata, attend, paged_attention, write_kv

if TYPE_CHECKING:
    from kvserve.model.kernels.backend import KernelBackend
    from kvserve.model.lora import LoRABatch


@dataclass
class Step:
    """What every layer of one forward pass shares."""

    positions: torch.Tensor                  # [T] or [B, T]
    meta: AttentionMetadata | None           # None: dense causal attention over [B, T]
    cos: torch.Tensor | None = None          # [*positions.shape, head_dim] (PyTorch RoPE)
    sin: torch.Tensor | None = None
    cos_local: torch.Tensor | None = None    # the sliding layers' tables when their RoPE base differs
    sin_local: torch.Tensor | None = None
    mask: torch.Tensor | None = None         # dense only: [T, T] bool, True where a query may attend (None: causal)
    lora: LoRABatch | None = None            # the step's adapters (model/lora.py); None: the base on every row


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, H, D]; cos/sin [..., T, D] (Hugging Face's rotate-half layout)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rot * sin.unsqueeze(-2)


class TorchOps:
    """The layer ops in PyTorch. `rotary` maps positions to cos/sin tables (`rotary_local`: those of
    sliding-window layers, when their RoPE base differs); `backend` (optional) lends paged attention
    its C decode kernel where it has one.

    The family features live here too, each a no-op for the Llama shape: RMSNorm on q and k
    (per head, or over the whole projection), a sliding window and logit soft-capping
    (`layer.sliding_window`, `layer.softcap`), GeGLU (`gelu_mul`)."""

    def __init__(self, rotary: torch.nn.Module, backend: KernelBackend | None = None,
                 rotary_local: torch.nn.Module | None = None) -> None:
        self.rotary = rotary
        self.backend = backend
        self.rotary_local = rotary_local

    def prepare(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None,
                kv_caches: list[torch.Tensor] | None) -> Step | None:
        cos, sin = self.rotary(positions)
        step = Step(positions, meta, cos, sin)
        if self.rotary_local is not None:
            step.cos_local, step.sin_local = self.rotary_local(positions)
        return step

    def set_capture(self, layers: tuple[int, ...]) -> None:
        """Which layers' residual stream forward_stack copies, normalised, into `aux` (none here: no stack)."""

    def forward_stack(self, x: torch.Tensor, step: Step, kv_caches: list[torch.Tensor] | None,
                      lora=None, aux: torch.Tensor | None = None) -> torch.Tensor | None:
        """The whole layer stack and final norm in one call, or None: run the layers one by one.
        lora: the step's LoRABatch (None: no adapter rows). aux [T, n, H]: receives the
        residual stream after each set_capture layer, normalised as by model.decoder.FeatureNorm."""
        return None

    def rms_norm(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        return norm(x)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """SwiGLU: gu [..., 2I] (gate then up) -> silu(gate) * up [..., I]."""
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """GeGLU: gu [..., 2I] -> gelu_tanh(gate) * up [..., I] (Gemma)."""
        gate, up = gu.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def attention(self, qkv: torch.Tensor, layer: torch.nn.Module, step: Step,
                  kv_cache: torch.Tensor | None) -> torch.Tensor:
        """qkv [*lead, q + 2 kv] -> attention output [*lead, q]; with metadata, the new K/V are
        written to the paged cache first and attention reads the cache."""
        lead = qkv.shape[:-1]
        q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        if layer.qk_norm == "full":         # OLMoE: over the whole projection, before the head split
            q, k = self.rms_norm(q, layer.q_norm), self.rms_norm(k, layer.k_norm)
        q = q.view(*lead, layer.num_heads, layer.head_dim)
        k = k.view(*lead, layer.num_kv_heads, layer.head_dim)
        if layer.qk_norm == "head":         # Qwen3, Gemma 3: each head's vector
            q, k = layer.q_norm(q), layer.k_norm(k)
        cos, sin = (step.cos_local, step.sin_local) if layer.local_rope else (step.cos, step.sin)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(*lead, layer.num_kv_heads, layer.head_dim)
        window, softcap = layer.sliding_window, layer.softcap
        if step.meta is None and (window or softcap):
            o = torch.stack([attend(q[b], k[b], v[b], layer.scale, window, softcap) for b in range(q.shape[0])])
        elif step.meta is None:   # dense causal attention over [B, T] (training, reference checks)
            rep = layer.num_heads // layer.num_kv_heads   # K/V expanded to every head: the fused
            kt = k.transpose(1, 2).repeat_interleave(rep, dim=1)   # SDPA kernel also runs under autograd
            vt = v.transpose(1, 2).repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, attn_mask=step.mask,
                                               is_causal=step.mask is None, scale=layer.scale).transpose(1, 2)
        else:   # sliding layers of a model with both kinds read their own pool (engine/kv_hybrid.py)
            meta = step.meta.local if window and step.meta.local is not None else step.meta
            write_kv(kv_cache, k, v, meta.slot_mapping)
            o = paged_attention(q, kv_cache, meta, layer.scale, self.backend, window, softcap)
        return o.reshape(*lead, layer.q_size)
