"""Activation-aware per-channel scales before rounding (AWQ, Lin et al. 2023), searched on text.

A few input channels of each projection carry much larger activations than the rest; rounding
errors of the weights in those columns cost the most. For a group of projections that read the
same input X (q/k/v; gate/up; down; o) we scale weight column c by s_c and divide the input by
s_c, folded exactly into what produces X: the RMSNorm weight before q/k/v and gate/up, the rows
of up_proj before down (act = silu(gate) * up is linear in up), the rows of v_proj before o
(attention output is a convex mix of V rows; with GQA the scale of a query head's channel is its
KV head's). The model is the same function; only where rounding lands changes.

s = mean|X_c| ** alpha (normalised around 1), alpha from a grid, chosen per group to minimise
|| X (Q(W s)/s - W)^T ||^2 over calibration rows. alpha = 0 is plain rounding, so the chosen
scales are never worse than it on the calibration data.
"""

from __future__ import annotations

import sys

import torch

from kvserve.model.config import ModelConfig
from kvserve.tokenizer import Tokenizer
from kvserve.train.quant_formats import fake_quantize


class Progress:
    """A one-line progress bar on stderr (tqdm's, when the stream is a terminal or asked for)."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, leave=True,
                        dynamic_ncols=True, mininterval=0.5)

    def step(self, label: str) -> None:
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


ALPHAS = tuple(i / 10 for i in range(11))
ROWS_PER_GROUP = 256


def _collect(cfg: ModelConfig, weights: dict, tok: Tokenizer, text: str, n_tokens: int, seq_len: int = 256):
    """Per layer and projection group: (mean |x| per channel, up to ROWS_PER_GROUP sample rows)."""
    from kvserve.model.decoder import DecoderLM
    from kvserve.model.linear import WeightSource

    w = {k: (WeightSource(tuple(t.shape), tensor=t) if t.dim() == 2 and k != "model.embed_tokens.weight" else t)
         for k, t in weights.items()}
    net = DecoderLM.from_weights(cfg, w, "fp32").eval()
    ids = tok.encode(text, add_special_tokens=True)[:n_tokens]
    seq_len = min(seq_len, cfg.max_position_embeddings)
    n_win = max(1, len(ids) // seq_len)
    x = torch.tensor(ids[: n_win * seq_len] if len(ids) >= seq_len else ids).reshape(n_win, -1)
    stats: dict[tuple[int, str], list] = {}
    gen = torch.Generator().manual_seed(0)

    def hook(key):
        def fn(_mod, inp):
            a = inp[0].detach().reshape(-1, inp[0].shape[-1]).float()
            keep = a[torch.randperm(a.shape[0], generator=gen)[: ROWS_PER_GROUP // n_win + 1]]
            s = stats.setdefault(key, [torch.zeros(a.shape[1], dtype=torch.float64), 0, []])
            s[0] += a.abs().sum(0).double()
            s[1] += a.shape[0]
            s[2].append(keep)
        return fn

    handles = []
    for i, layer in enumerate(net.layers):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            handles.append(getattr(layer, name).register_forward_pre_hook(hook((i, name))))
    with torch.no_grad():
        for r in range(x.shape[0]):
            net(x[r: r + 1])
    for h in handles:
        h.remove()
    return {k: ((v[0] / v[1]).float(), torch.cat(v[2])[:ROWS_PER_GROUP]) for k, v in stats.items()}


def _search(ws: list[torch.Tensor], mean_abs: torch.Tensor, rows: torch.Tensor, qtype: str,
            tie: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, float, float]:
    """Best per-column scale for weights `ws` (sharing one input); returns (s, err at alpha=0, best err).
    tie=(Hq, Hkv, D): tie channels of query heads that share a KV head (o_proj's input)."""
    w = torch.cat(ws).float()
    ref = rows @ w.T
    base = mean_abs.clamp(min=1e-5)
    if tie is not None:
        hq, hkv, d = tie
        base = base.view(hkv, hq // hkv, d).mean(1, keepdim=True).expand(hkv, hq // hkv, d).reshape(-1)
    best, best_s, plain = float("inf"), torch.ones_like(base), float("nan")
    for alpha in ALPHAS:
        s = base.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        wq = torch.from_numpy(fake_quantize((w * s).numpy(), qtype)) / s
        err = float(((rows @ wq.T - ref) ** 2).sum())
        if alpha == 0:
            plain = err
        if err < best:
            best, best_s = err, s
    return best_s, plain, best


def awq_scale(cfg: ModelConfig, weights: dict[str, torch.Tensor], tok: Tokenizer, text: str, qtype: str,
              n_tokens: int = 4096, progress: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Scaled copies of `weights` (HF names, fp32) for `qtype`, and a report of the output
    errors on the calibration rows, plain rounding vs scaled, summed over the model."""
    stats = _collect(cfg, weights, tok, text, n_tokens)
    w = {k: v.clone() for k, v in weights.items()}
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    bar = Progress(cfg.num_hidden_layers * 4, f"calibrate {qtype}", progress)
    plain_total, best_total = 0.0, 0.0
    for i in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        groups = [
            ("qkv_proj", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], None),
            ("o_proj", [a + "o_proj.weight"], (hq, hkv, d)),
            ("gate_up_proj", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], None),
            ("down_proj", [p + "mlp.down_proj.weight"], None),
        ]
        for group, names, tie in groups:
            mean_abs, rows = stats[(i, group)]
            s, plain, best = _search([w[n] for n in names], mean_abs, rows, qtype, tie)
            plain_total += plain
            best_total += best
            for n in names:
                w[n] = w[n] * s
            if group == "qkv_proj":
                w[p + "input_layernorm.weight"] = w[p + "input_layernorm.weight"] / s
            elif group == "gate_up_proj":
                w[p + "post_attention_layernorm.weight"] = w[p + "post_attention_layernorm.weight"] / s
            elif group == "down_proj":
                w[p + "mlp.up_proj.weight"] = w[p + "mlp.up_proj.weight"] / s[:, None]
            else:   # o_proj: its input is the attention output, a mix of V rows
                s_kv = s.view(hkv, hq // hkv, d)[:, 0].reshape(-1)
                w[a + "v_proj.weight"] = w[a + "v_proj.weight"] / s_kv[:, None]
                if a + "v_proj.bias" in w:
                    w[a + "v_proj.bias"] = w[a + "v_proj.bias"] / s_kv
            bar.step(f"layer {i} {group}")
    bar.close()
    return w, {"output_error_plain": plain_total, "output_error_calibrated": best_total,
               "reduction": float(1 - best_total / plain_total) if plain_total else 0.0}

