"""Mixture of Experts: a router picks `top_k` of `num_experts` FFN experts per token per layer.

    probs = softmax(router(h))            # float32, over all experts
    w, e  = top_k(probs)                  # the token's experts and their weights
    w     = w / sum(w)   if norm_topk_prob (Mixtral, Qwen3-MoE; not Qwen2-MoE, OLMoE)
    y     = sum_j w_j * expert_{e_j}(h)  [+ sigmoid(shared_gate(h)) * shared_expert(h)]

Experts run grouped by expert: the step's (token, expert) pairs are sorted by expert, and each
active expert runs one gate/up and one down projection over all of its tokens (one GEMM each,
through the same `Linear` protocol as every other weight, so GGUF-quantized experts stay packed
on the int8 kernels). A token's result is the sum of its experts' weighted outputs in top-k rank
order, so it depends only on the token itself, never on the other rows in the batch (with batch-invariant
Linears, as the packed GGUF ones are).

Each MoE layer counts the tokens routed to each expert (`token_counts`, cumulative; the engine
reports them as a metric).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.linear import Linear


class Expert(nn.Module):
    """A gated FFN: down(act(gate) * up), gate and up fused into one projection."""

    def __init__(self, gate_up_proj: Linear, down_proj: Linear, act: str):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act = gate_up_proj, down_proj, act

    def forward(self, h: torch.Tensor, ops=None) -> torch.Tensor:
        """ops: the layer ops (model/ops.py) whose SwiGLU to use (C on CpuOps); None: PyTorch."""
        gu = self.gate_up_proj(h)
        if ops is not None and self.act == "silu":
            return self.down_proj(ops.silu_mul(gu))
        return self.down_proj(gated_act(gu, self.act))


def gated_act(gu: torch.Tensor, act: str) -> torch.Tensor:
    """gu [..., 2I] (gate then up) -> act(gate) * up [..., I]; SwiGLU or GeGLU (tanh GELU)."""
    gate, up = gu.chunk(2, dim=-1)
    if act == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


class MoEBlock(nn.Module):
    def __init__(self, router: Linear, experts: list[Expert], top_k: int, norm_topk_prob: bool,
                 shared_expert: Expert | None = None, shared_expert_gate: Linear | None = None):
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.register_buffer("token_counts", torch.zeros(len(experts), dtype=torch.int64), persistent=False)
        self.last_experts: torch.Tensor | None = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, H] -> (weights [N, k] float32, expert ids [N, k])."""
        probs = torch.softmax(self.router(h).float(), dim=-1)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w, idx

    def forward(self, h: torch.Tensor, ops=None) -> torch.Tensor:
        """h [N, H] float32 -> [N, H]; ops: the layer ops (for the experts' SwiGLU)."""
        w, idx = self.route(h)
        if idx.shape[0] == 1:                                 # a lone decode token: no grouping to do
            out = self._one_token(h, w, idx, ops)
        else:
            out = self._grouped(h, w, idx, ops)
        if self.shared_expert is not None:
            s = self.shared_expert(h, ops)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(self.shared_expert_gate(h)) * s
            out = out + s
        return out

    def _one_token(self, h: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, ops) -> torch.Tensor:
        """`_grouped` for one token, without the sort and scatter: the same arithmetic (each expert
        on the [1, H] row, times its weight, summed in rank order), so the same bits."""
        self.token_counts[idx[0].to(self.token_counts.device)] += 1   # top-k ids are distinct
        self.last_experts = idx
        out = None
        for j, e in enumerate(idx[0].tolist()):
            y = self.experts[e](h, ops) * w[:, j:j + 1]
            out = y if out is None else out + y
        return out

    def _grouped(self, h: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, ops) -> torch.Tensor:
        n, k = idx.shape
        flat = idx.reshape(-1)                      # pair p: token p // k, its rank-(p % k) expert
        order = torch.argsort(flat, stable=True)    # pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=len(self.experts))
        self.token_counts += counts.to(self.token_counts.device)
        self.last_experts = idx                     # [N, k], read by the runner for per-request counts
        ys = torch.empty(n * k, h.shape[-1], dtype=h.dtype, device=h.device)
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c:
                pairs = order[start:start + c]
                ys[pairs] = self.experts[e](h[pairs // k], ops)
                start += c
        ys = ys.view(n, k, -1) * w.unsqueeze(-1)
        out = ys[:, 0]
        for j in range(1, k):                       # a fixed, per-token order: rank 0, 1, ...
            out = out + ys[:, j]
        return out


def build_moe(cfg, prefix: str, lin) -> MoEBlock:
    """A MoEBlock from HF-named weights under `prefix` (`model.layers.{i}.mlp.`): `gate.weight` (the
    router), `experts.{e}.{gate,up,down}_proj.weight`, and Qwen2-MoE's `shared_expert.*` and
    `shared_expert_gate.weight`. `lin(names)` makes one Linear from one or more fused weights."""
    def expert(p: str) -> Expert:
        return Expert(lin([p + "gate_proj.weight", p + "up_proj.weight"]), lin([p + "down_proj.weight"]),
                      cfg.hidden_act)

    experts = [expert(f"{prefix}experts.{e}.") for e in range(cfg.num_experts)]
    shared = gate = None
    if cfg.shared_expert_intermediate_size:
        shared = expert(prefix + "shared_expert.")
        gate = lin([prefix + "shared_expert_gate.weight"])
    return MoEBlock(lin([prefix + "gate.weight"]), experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, shared, gate)
