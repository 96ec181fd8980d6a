"""DecoderLM: the one decoder-only transformer every served family runs on, read top to bottom.
Llama 1-3, SmolLM2, Mistral and Qwen2 are its plain shape:

    tokens -> embedding -> N x [RMSNorm -> attention (RoPE, GQA, paged KV) -> +residual
                                RMSNorm -> SwiGLU MLP -> +residual] -> RMSNorm -> lm_head

The architectures differ only in config values: q/k/v bias (Qwen2), rope scaling (Llama 3),
KV-head count (GQA/MQA), tied embeddings. Q/K/V and gate/up projections are fused into one
matmul each. The other families (families.py: Qwen3, Phi-3, Gemma 2/3, the MoE ones) are this
file too, switched by config fields: q/k-norm and sliding windows and soft-capping in the ops'
attention, Gemma's extra norms and GeGLU in the layer, a MoEBlock (moe.py) in place of the MLP.
Gemma 2/3 run on the C layer ops and whole-stack forward like the Llama shapes (their features are
fields of the C layer descriptors, `config.c_layer_ops`); Mixtral keeps the C layer ops around its
experts; the others run on the PyTorch layer ops. Two ways in:
  * `forward(input_ids [B, T])` with no metadata: plain causal attention over the batch,
    for training and for checking against a reference implementation;
  * `forward(input_ids [T], positions [T], attn_metadata, kv_caches)`: a flattened batch of
    many sequences' new tokens, reading and writing the paged KV cache (see attention.py).
Everything a step adds is an argument, never state on the model: `lora=` the step's LoRABatch
(model/lora.py: each adapter's rows), and `forward_features(..., capture_layers)` also returns the
RMS-normalised residual rows of those inner layers (what an EAGLE-3 draft reads).
The model holds the KernelBackend it was built with; the layer math between projections comes
from `backend.layer_ops(model)` (C on CPUs with the kernels) or PyTorch (autograd, dense calls,
steps the C code does not handle).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.errors import ModelLoadError
from kvserve.model.attention import AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.linear import PACKED_FORMATS, DenseLinear, Linear, WeightSource, make_linear
from kvserve.model.lora import LoRABatch
from kvserve.model.moe import build_moe
from kvserve.model.ops import Step, TorchOps
from kvserve.model.rope import RotaryEmbedding, rope_inv_freq  # noqa: F401 - rope_inv_freq: re-exported

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.float().contiguous(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class FeatureNorm:
    """RMS normalisation without a weight (eps: float32's), for the residual rows a forward captures
    (their scales differ by orders across layers, and raw ones overflow fp16). Not a module: it has
    nothing to save. The C whole-stack forward computes the same with a unit weight."""

    eps = torch.finfo(torch.float32).eps          # kvs_forward_lora uses FLT_EPSILON

    def __init__(self, hidden: int):
        self.weight = torch.ones(hidden)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), None, self.eps)


class DecoderLayer(nn.Module):
    """One block: RMSNorm -> attention -> +residual, RMSNorm -> SwiGLU MLP -> +residual. The math
    between the projections is the `ops` object's (model/ops.py): PyTorch, or the C kernels.
    Optional parts (None for Llama): q_norm/k_norm, Gemma's post-attention and pre/post-feedforward
    norms (`post_attention_layernorm` then normalises the attention output), a MoEBlock `mlp`."""

    def __init__(self, cfg: ModelConfig, w: dict[str, nn.Module], index: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.sliding_window = cfg.window_of(index)
        self.local_rope = self.sliding_window is not None and cfg.rope_local_theta is not None
        self.softcap = cfg.attn_logit_softcapping
        self.qk_norm = cfg.qk_norm
        self.act = cfg.hidden_act
        self.index = index
        self.input_layernorm = w["input_layernorm"]
        self.qkv_proj = w["qkv_proj"]
        self.o_proj = w["o_proj"]
        self.post_attention_layernorm = w["post_attention_layernorm"]
        self.q_norm, self.k_norm = w.get("q_norm"), w.get("k_norm")
        self.pre_feedforward_layernorm = w.get("pre_feedforward_layernorm")
        self.post_feedforward_layernorm = w.get("post_feedforward_layernorm")
        self.mlp = w.get("mlp")
        self.gate_up_proj = w.get("gate_up_proj")
        self.down_proj = w.get("down_proj")
        self.intermediate_size = self.gate_up_proj.out_features // 2 if self.gate_up_proj is not None else 0

    def forward(self, x: torch.Tensor, step: Step, kv_cache: torch.Tensor | None, ops: TorchOps) -> torch.Tensor:
        """x [T, H] (paged) or [B, T, H] (dense) -> the same shape."""
        lead, hidden = x.shape[:-1], x.shape[-1]               # [T] or [B, T]
        lora = step.lora
        h = ops.rms_norm(x, self.input_layernorm).reshape(-1, hidden)
        qkv = self._project("qkv_proj", h, lora).view(*lead, -1)
        o = ops.attention(qkv, self, step, kv_cache)
        a = self._project("o_proj", o.reshape(-1, self.q_size), lora).view(*lead, -1)
        if self.pre_feedforward_layernorm is not None:           # Gemma: norms on both sides
            x = x + ops.rms_norm(a, self.post_attention_layernorm)
            h = ops.rms_norm(x, self.pre_feedforward_layernorm).reshape(-1, hidden)
        else:
            x = x + a
            h = ops.rms_norm(x, self.post_attention_layernorm).reshape(-1, hidden)
        if self.mlp is not None:
            m = self.mlp(h, ops)
        else:
            gu = self._project("gate_up_proj", h, lora)
            m = self._project("down_proj", ops.silu_mul(gu) if self.act == "silu" else ops.gelu_mul(gu), lora)
        m = m.view(*lead, -1)
        if self.post_feedforward_layernorm is not None:
            m = ops.rms_norm(m, self.post_feedforward_layernorm)
        return x + m

    def _project(self, name: str, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """Projection `name` of x, plus the step's adapters' low-rank products on their rows."""
        y = getattr(self, name)(x)
        return y if lora is None else lora.add(y, x, self.index, name)


class DecoderLM(nn.Module):
    """The causal decoder of every generative family (config fields switch the parts, see the
    module docstring); the engine, the trainers and the draft heads all run this class."""

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor | nn.Module, layers: list[DecoderLayer],
                 norm: RMSNorm, lm_head: nn.Module, backend: KernelBackend | None = None):
        """embed: the fp32 table, or a packed Linear whose rows() are the embeddings (the lm_head
        itself when tied): no fp32 copy of a 49k x 576 table (113 MB) is then kept.
        backend: the kernel choices the projections were built with (default: PyTorch only)."""
        super().__init__()
        self.config = cfg
        self.backend = backend or KernelBackend.pytorch()
        self._ops: tuple[KernelBackend, TorchOps] | None = None   # layer ops, built for self.backend
        if isinstance(embed, torch.Tensor):
            self.embed_tokens = nn.Parameter(embed, requires_grad=False)
            self.packed_embed = None
        else:
            self.register_parameter("embed_tokens", None)
            self.packed_embed = embed if embed is not lm_head else None   # None: tied, read lm_head
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rotary = RotaryEmbedding(cfg)
        self.rotary_local = RotaryEmbedding(cfg, cfg.rope_local_theta) if cfg.rope_local_theta else None
        self.capture_norm = FeatureNorm(cfg.hidden_size)   # forward_features' inner rows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn_metadata: AttentionMetadata | None = None,
                kv_caches: list[torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                *, lora: LoRABatch | None = None) -> torch.Tensor:
        """Hidden states after the final norm: [B, T, H] (dense) or [T, H] (paged).
        inputs_embeds: the first layer's input instead of the token embeddings (an EAGLE draft
        feeds its fused features, spec_decode/eagle.py); input_ids then only give the shape.
        attn_mask: dense only, [T, T] bool, which positions each may attend to (default causal;
        training an EAGLE head on its own chained steps, train/draft.py).
        lora: the step's adapters and their rows (None: the base model on every row)."""
        return self.forward_features(input_ids, positions, attn_metadata, kv_caches, inputs_embeds, attn_mask,
                                     lora=lora)[0]

    def forward_features(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                         attn_metadata: AttentionMetadata | None = None,
                         kv_caches: list[torch.Tensor] | None = None,
                         inputs_embeds: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                         *, lora: LoRABatch | None = None,
                         capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and the residual stream after each of `capture_layers`, RMS-normalised
        (FeatureNorm), [T, n, H] in that order: a paged inference step only (None otherwise or
        without layers). An EAGLE-3-style draft reads them beside the final hidden state."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if self.config.gemma_norms:   # Gemma scales the embeddings by sqrt(hidden)
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        reference = TorchOps(self.rotary, self.backend, self.rotary_local)
        ops, step = reference, None
        cap = capture_layers if attn_metadata is not None and kv_caches is not None else ()
        aux = torch.empty(x.shape[0], len(cap), x.shape[-1]) if cap else None
        if attn_metadata is not None and kv_caches is not None and not torch.is_grad_enabled():
            ops = self.layer_ops()
            step = ops.prepare(x, positions, attn_metadata, kv_caches)
            if step is None:
                ops = reference
            else:
                if aux is not None:
                    ops.set_capture(cap)
                out = ops.forward_stack(x, step, kv_caches, lora=lora, aux=aux)   # LoRA rows: the C forward adds them
                if out is not None:
                    return out, aux
        if step is None:
            step = ops.prepare(x, positions, attn_metadata, kv_caches)
        step.lora = lora
        if attn_mask is not None:
            if (attn_metadata is not None or self.config.attn_logit_softcapping
                    or any(self.config.window_of(i) for i in range(len(self.layers)))):
                raise ValueError("attn_mask is for dense attention without a sliding window or soft-capping")
            step.mask = attn_mask
        for i, layer in enumerate(self.layers):
            x = layer(x, step, None if kv_caches is None else kv_caches[i], ops)
            if i in cap:
                aux[:, cap.index(i)] = ops.rms_norm(x, self.capture_norm)
        return ops.rms_norm(x, self.norm), aux

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, float32 [*input_ids.shape, hidden]."""
        if self.embed_tokens is not None:
            return F.embedding(input_ids, self.embed_tokens).float()
        return self.packed_embedding().rows(input_ids)

    def packed_embedding(self) -> nn.Module | None:
        """The packed Linear whose rows() are the token embeddings (the LM head when tied), or None
        when the model keeps an fp32 table."""
        if self.embed_tokens is not None:
            return None
        return self.lm_head if self.packed_embed is None else self.packed_embed

    def __getstate__(self) -> dict:
        """Copies (copy.deepcopy for a DPO/GRPO reference model) rebuild their layer ops on first
        use: the C ops hold pointers into this model's own tensors."""
        return {**self.__dict__, "_ops": None}

    def layer_ops(self) -> TorchOps:
        """The ops between projections for paged inference steps, built on first use for the
        current `self.backend` (assigning another backend, as tests do, rebuilds them)."""
        if self._ops is None or self._ops[0] is not self.backend:
            ops = (self.backend.layer_ops(self) if self.config.c_layer_ops
                   else TorchOps(self.rotary, self.backend, self.rotary_local))
            self._ops = (self.backend, ops)
        return self._ops[1]

    def expert_token_counts(self) -> list[list[int]]:
        """Per MoE layer, the tokens routed to each expert so far (empty for a dense model)."""
        return [layer.mlp.token_counts.tolist() for layer in self.layers if layer.mlp is not None]

    def last_expert_counts(self, query_lens: list[int]) -> list[list[int]] | None:
        """Tokens each expert took in the last forward, summed over the MoE layers, per sequence of
        the flattened batch (query_lens: its rows per sequence); None for a dense model."""
        routed = [layer.mlp.last_experts for layer in self.layers if layer.mlp is not None]
        if not routed or routed[0] is None:
            return None
        n_exp = len(self.layers[0].mlp.experts)
        seq_of = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        keys = seq_of[None, :, None] * n_exp + torch.stack(routed).cpu()
        return torch.bincount(keys.reshape(-1), minlength=len(query_lens) * n_exp).view(-1, n_exp).tolist()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        lead = hidden.shape[:-1]
        logits = self.lm_head(hidden.reshape(-1, hidden.shape[-1])).view(*lead, -1)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_weights(cls, cfg: ModelConfig, w: dict[str, WeightSource | torch.Tensor],
                     weight_format: str = "auto", backend: KernelBackend | None = None) -> DecoderLM:
        """Build from HF-named weights (`model.layers.0.self_attn.q_proj.weight`, ...); 1-D
        tensors (norms, biases) are plain tensors, projections are WeightSources. `backend`
        (default: PyTorch only) decides the kernels; load_model passes the detected one."""
        backend = backend or KernelBackend.pytorch()

        def lin(names: list[str], bias_names: list[str] | None = None) -> Linear:
            missing = [n for n in names if n not in w]
            if missing:
                raise ModelLoadError(f"model file is missing tensor {missing[0]} ({cfg.architecture})")
            src = WeightSource.concat([w[n] for n in names]) if len(names) > 1 else w[names[0]]
            bias = None
            if bias_names and all(b in w for b in bias_names):
                bias = torch.cat([w[b].float() for b in bias_names])
            return _noted(make_linear(src, bias, weight_format, backend=backend), src)

        def norm(name: str) -> RMSNorm:   # Gemma's norms scale by (1 + w): fold the 1 in once
            if name not in w:
                raise ModelLoadError(f"model file is missing tensor {name} ({cfg.architecture})")
            return RMSNorm(w[name].float() + 1.0 if cfg.gemma_norms else w[name], cfg.rms_norm_eps)

        layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = [a + "qkv_proj.weight"] if a + "qkv_proj.weight" in w else [a + f"{n}_proj.weight" for n in "qkv"]
            parts = {
                "input_layernorm": norm(p + "input_layernorm.weight"),
                "qkv_proj": lin(qkv, [a + f"{n}_proj.bias" for n in "qkv"]),
                "o_proj": lin([a + "o_proj.weight"]),
                "post_attention_layernorm": norm(p + "post_attention_layernorm.weight"),
            }
            if cfg.qk_norm:
                parts.update(q_norm=norm(a + "q_norm.weight"), k_norm=norm(a + "k_norm.weight"))
            if cfg.gemma_norms:
                parts.update(pre_feedforward_layernorm=norm(p + "pre_feedforward_layernorm.weight"),
                             post_feedforward_layernorm=norm(p + "post_feedforward_layernorm.weight"))
            if cfg.num_experts:
                parts["mlp"] = build_moe(cfg, p + "mlp.", lin)
            else:
                gu = [p + "mlp.gate_up_proj.weight"] if p + "mlp.gate_up_proj.weight" in w else [
                    p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
                parts.update(gate_up_proj=lin(gu), down_proj=lin([p + "mlp.down_proj.weight"]))
            layers.append(DecoderLayer(cfg, parts, i))
        emb_src = w["model.embed_tokens.weight"]
        head_src = w.get("lm_head.weight")
        tied = head_src is None or cfg.tie_word_embeddings
        embed: torch.Tensor | Linear | None = None
        if (isinstance(emb_src, WeightSource) and emb_src.raw is not None
                and weight_format in ("auto", "gguf", *PACKED_FORMATS)):
            # Packed GGUF embedding: look rows up from the packed weights where a variant holds them.
            packed = make_linear(emb_src, None, weight_format, lookup_only=not tied, backend=backend)
            if packed.supports_rows:
                embed = packed
        if embed is None:
            embed = emb_src.dequantize() if isinstance(emb_src, WeightSource) else emb_src.float()
        if tied:
            if isinstance(embed, nn.Module):
                lm_head = embed
            else:
                head_src = emb_src if isinstance(emb_src, WeightSource) else WeightSource(tuple(embed.shape), embed)
                lm_head = _noted(make_linear(head_src, None, weight_format, backend=backend), head_src)
        else:
            lm_head = _noted(make_linear(head_src, None, weight_format, backend=backend), head_src)
        model = cls(cfg, embed, layers, norm("model.norm.weight"), lm_head, backend)
        # a model the kernels could run but that is partly off their fast path says so louder (kvserve run shows warnings)
        slow = backend.lib is not None and bool(backend.slow_paths(model))
        logger.log(logging.WARNING if slow else logging.INFO, "%s", backend.describe_model(model))
        if isinstance(lm_head, DenseLinear) and lm_head.weight.dtype == torch.float32 and (
                cfg.tie_word_embeddings or "lm_head.weight" not in w):
            model.lm_head.weight = model.embed_tokens   # tied: one parameter, not a copy
        return model

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> DecoderLM:
        """A freshly initialised fp32 model (for training): normal(0, std) weights, unit norms."""
        g = torch.Generator().manual_seed(seed)
        return cls.from_weights(cfg, random_hf_weights(cfg, g, std), "fp32")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under Hugging Face names, fused projections split again (fp32, dense only)."""
        cfg = self.config
        sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed_tokens.detach()}
        for i, layer in enumerate(self.layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            q, k, v = layer.qkv_proj.weight.detach().split([layer.q_size, layer.kv_size, layer.kv_size])
            sd.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v,
                       a + "o_proj.weight": layer.o_proj.weight.detach()})
            if layer.qkv_proj.bias is not None:
                qb, kb, vb = layer.qkv_proj.bias.detach().split([layer.q_size, layer.kv_size, layer.kv_size])
                sd.update({a + "q_proj.bias": qb, a + "k_proj.bias": kb, a + "v_proj.bias": vb})
            gate, up = layer.gate_up_proj.weight.detach().split(layer.intermediate_size)
            sd.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                       p + "mlp.down_proj.weight": layer.down_proj.weight.detach(),
                       p + "input_layernorm.weight": layer.input_layernorm.weight.detach(),
                       p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight.detach()})
        sd["model.norm.weight"] = self.norm.weight.detach()
        if not cfg.tie_word_embeddings:
            sd["lm_head.weight"] = self.lm_head.weight.detach()
        return {k: t.float().contiguous() for k, t in sd.items()}


def _noted(lin: Linear, src: WeightSource | torch.Tensor) -> Linear:
    """A dense projection remembers its weights' file format, for the start-up line's "why"
    (KernelBackend.slow_paths): "Q6_K" (a GGUF type without a packed variant) or a dtype."""
    if isinstance(lin, DenseLinear):
        raw = getattr(src, "raw", None) is not None
        if getattr(src, "parts", None) is not None:     # a mixed-type fusion: its members' types
            lin.source_format = "+".join(sorted({p.qtype.name if p.raw is not None else "dense" for p in src.parts}))
            return lin
        lin.source_format = src.qtype.name if raw else str(getattr(src, "tensor", src).dtype).replace("torch.", "")
    return lin


def random_hf_weights(cfg: ModelConfig, g: torch.Generator, std: float = 0.02) -> dict:
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def mat(o: int, i: int) -> WeightSource:
        return WeightSource((o, i), tensor=torch.randn(o, i, generator=g) * std)

    w: dict = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g) * std,
               "model.norm.weight": torch.ones(h)}
    for i in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        w.update({a + "q_proj.weight": mat(q, h), a + "k_proj.weight": mat(kv, h),
                  a + "v_proj.weight": mat(kv, h), a + "o_proj.weight": mat(h, q),
                  p + "mlp.gate_proj.weight": mat(inter, h), p + "mlp.up_proj.weight": mat(inter, h),
                  p + "mlp.down_proj.weight": mat(h, inter),
                  p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h)})
        if cfg.attention_bias:
            w.update({a + "q_proj.bias": torch.zeros(q), a + "k_proj.bias": torch.zeros(kv),
                      a + "v_proj.bias": torch.zeros(kv)})
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = mat(cfg.vocab_size, h)
    return w
