"""LoRA adapters at inference: PEFT's files in, a grouped low-rank product on every projection.

An adapter (PEFT layout: `adapter_config.json` + `adapter_model.safetensors`) adds to a projection
W the product `scale * B A` (A [r, in], B [out, r]). kvserve fuses q/k/v and gate/up into one
projection each, so an adapter's per-module pairs are fused the same way when it is loaded:

    A_qkv = [A_q; A_k; A_v]   [r_q + r_k + r_v, in]
    B_qkv = block-diagonal:  rows of q's output take B_q * scale_q on q's r columns, and so on

so every projection of every layer holds at most one (A, B) per adapter, and the extra output is
`(x A^T) B^T`. The scale is folded into B once.

Many adapters in one batch (Punica / S-LoRA): the runner passes the model's forward a `LoRABatch`
(`lora=`), the rows of each adapter in the flattened batch, and each decoder layer adds, after
each projection (every Linear variant, the `Linear` protocol of linear.py), each adapter's product
on its rows; base rows get nothing added. Batch invariance: a row's product must not depend on how many other rows share it (a
plain GEMM's per-row bits change with M on MKL), so each row's two products are a batch of
per-row GEMVs (`torch.bmm` with M = 1): a row's numbers are the same alone, grouped or batched.
The C whole-stack forward (kernels/cpu/kvserve_forward.cpp, `kvs_forward_lora`) takes the same
adapters as a table of (A, B^T, r) per layer, projection and slot and a slot per row, and adds
each adapted row's B (A x) after the projection, in a fixed order; steps it does not
run go through the per-layer path and `LoRABatch.add`.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvserve.errors import InvalidRequest, ModelNotFound
from kvserve.model.config import ModelConfig

# HF module name -> (kvserve's fused projection, part index within it)
MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
           "down_proj": ("down_proj", 0)}
SHORT = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
         "down": "down_proj"}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_ids = itertools.count(1)


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each HF projection of a Llama-shaped layer."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def parts_of(cfg: ModelConfig, proj: str) -> list[str]:
    return [m for m, (p, _) in sorted(MODULES.items(), key=lambda kv: kv[1][1]) if p == proj]


@dataclass(eq=False)
class LoRAAdapter:
    """One adapter, fused for kvserve's projections: `layers[i][proj] = (A [R, in], B [out, R])`."""

    name: str
    path: str
    rank: int
    target_modules: list[str]
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    key: str = ""                       # unique per load: the prefix cache's salt for this adapter
    nbytes: int = 0
    base_model: str | None = None
    extra: dict = field(default_factory=dict)


def read_config(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_dir():
        raise ModelNotFound(f"LoRA adapter directory {str(p)!r} does not exist", param="lora_path")
    cfg_file = p / "adapter_config.json"
    if not cfg_file.is_file() or not (p / "adapter_model.safetensors").is_file():
        raise InvalidRequest(f"{str(p)!r} is not a PEFT adapter: it needs adapter_config.json and "
                             "adapter_model.safetensors", param="lora_path")
    try:
        conf = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"cannot read {cfg_file}: {e}", param="lora_path") from None
    if conf.get("peft_type", "LORA") != "LORA":
        raise InvalidRequest(f"adapter {str(p)!r} is {conf.get('peft_type')}, not LoRA", param="lora_path")
    if conf.get("use_dora"):
        raise InvalidRequest(f"adapter {str(p)!r} uses DoRA, which kvserve does not serve", param="lora_path")
    if conf.get("modules_to_save"):
        raise InvalidRequest(f"adapter {str(p)!r} saves full modules {conf['modules_to_save']} "
                             "(modules_to_save): kvserve serves low-rank adapters only", param="lora_path")
    if conf.get("bias", "none") != "none":
        raise InvalidRequest(f"adapter {str(p)!r} trains biases (bias={conf['bias']!r}); kvserve needs bias='none'",
                             param="lora_path")
    return conf


def load_adapter(path: str | os.PathLike, cfg: ModelConfig, name: str | None = None) -> LoRAAdapter:
    """Read a PEFT LoRA adapter and check it against the base's shapes; a mismatch (another base,
    another vocabulary, a module kvserve does not adapt) is one clear InvalidRequest."""
    conf = read_config(path)
    name = name or Path(path).name
    where = f"LoRA adapter {name!r} ({path})"
    try:
        tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
    except Exception as e:  # noqa: BLE001 - a corrupt file is the user's to fix
        raise InvalidRequest(f"{where}: cannot read adapter_model.safetensors: {e}", param="lora_path") from None
    shapes = module_shapes(cfg)
    alpha = float(conf.get("lora_alpha", conf.get("r", 8)))
    alpha_pattern, rank_pattern = conf.get("alpha_pattern") or {}, conf.get("rank_pattern") or {}
    rslora = bool(conf.get("use_rslora"))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        parts = key.split(".")
        if "lora_A" not in parts and "lora_B" not in parts:
            kind = ("the embeddings or lm_head" if any(s in key for s in ("embed", "lm_head"))
                    else f"tensor {key}")
            if t.dim() == 2 and t.shape[0] != cfg.vocab_size and ("embed" in key or "lm_head" in key):
                raise InvalidRequest(f"{where} was made for another base: its vocabulary has {t.shape[0]} "
                                     f"tokens, this model's {cfg.vocab_size}", param="lora_path")
            raise InvalidRequest(f"{where} adapts {kind}; kvserve serves LoRA on q,k,v,o,gate,up,down only",
                                 param="lora_path")
        ab = "A" if "lora_A" in parts else "B"
        cut = parts.index(f"lora_{ab}")
        module = parts[cut - 1]
        if module in ("embed_tokens", "lm_head"):
            raise InvalidRequest(f"{where} adapts {module}; kvserve serves LoRA on q,k,v,o,gate,up,down only",
                                 param="lora_path")
        if module not in MODULES or "layers" not in parts:
            raise InvalidRequest(f"{where} adapts {module!r}, which kvserve cannot adapt (q,k,v,o,gate,up,down)",
                                 param="lora_path")
        layer = int(parts[parts.index("layers") + 1])
        if layer >= cfg.num_hidden_layers:
            raise InvalidRequest(f"{where} was made for another base: it adapts layer {layer}, this model has "
                                 f"{cfg.num_hidden_layers}", param="lora_path")
        pairs.setdefault((layer, module), {})[ab] = t.float()
    if not pairs:
        raise InvalidRequest(f"{where} holds no LoRA weights", param="lora_path")
    if cfg.num_experts and any(m in ("gate_proj", "up_proj", "down_proj") for _, m in pairs):
        raise InvalidRequest(f"{where} adapts MLP projections of a mixture-of-experts model, which kvserve "
                             "does not serve", param="lora_path")
    per_layer: list[dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = [{} for _ in range(cfg.num_hidden_layers)]
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise InvalidRequest(f"{where}: layer {layer} {module} has only lora_{''.join(ab)}", param="lora_path")
        A, B = ab["A"], ab["B"]
        out_f, in_f = shapes[module]
        r = A.shape[0]
        if A.dim() != 2 or B.dim() != 2 or A.shape[1] != in_f or B.shape[0] != out_f or B.shape[1] != r:
            raise InvalidRequest(f"{where} was made for another base: layer {layer} {module} has A {tuple(A.shape)} "
                                 f"and B {tuple(B.shape)}, this model needs A [r, {in_f}] and B [{out_f}, r]",
                                 param="lora_path")
        a = float(_pattern(alpha_pattern, layer, module, alpha))
        r_conf = int(_pattern(rank_pattern, layer, module, conf.get("r", r)))
        if r_conf != r:
            raise InvalidRequest(f"{where}: layer {layer} {module} has rank {r}, its config says {r_conf}",
                                 param="lora_path")
        per_layer[layer][module] = (A, B, a / (r ** 0.5 if rslora else r))
    layers, nbytes = [], 0
    for mods in per_layer:
        fused = {}
        for proj in PROJECTIONS:
            names = [m for m in parts_of(cfg, proj) if m in mods]
            if not names:
                continue
            A = torch.cat([mods[m][0] for m in names]).contiguous()
            outs = [shapes[m][0] for m in parts_of(cfg, proj)]
            B = torch.zeros(sum(outs), A.shape[0])
            col = 0
            for m in names:
                a_m, b_m, s = mods[m]
                row = sum(outs[:parts_of(cfg, proj).index(m)])
                B[row:row + b_m.shape[0], col:col + a_m.shape[0]] = b_m * s
                col += a_m.shape[0]
            fused[proj] = (A, B.contiguous())
            nbytes += (A.numel() + B.numel()) * 4
        layers.append(fused)
    targets = sorted({m for _, m in pairs})
    rank = max(a.shape[0] for d in per_layer for (a, _, _) in d.values())
    return LoRAAdapter(name, str(path), rank, targets, layers, key=f"{name}#{next(_ids)}", nbytes=nbytes,
                       base_model=conf.get("base_model_name_or_path"))


def _pattern(pattern: dict, layer: int, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: keys are module-name suffixes or regexes."""
    name = f"model.layers.{layer}.{module}"
    for key, val in pattern.items():
        if name.endswith(key) or re.fullmatch(rf".*\.{key}", name) or key == module:
            return val
    return default


# ---- the batch -----------------------------------------------------------------------------------

@dataclass
class LoRABatch:
    """The adapters of one step: each with the rows of the flattened batch it applies to
    (None: every row). Rows of no group are the base model's. The runner builds it per step and
    passes it to the model's forward (`lora=`); each decoder layer then calls `add` after its
    projections, and the C whole-stack forward reads it as `c_terms`."""

    groups: list[tuple[LoRAAdapter, torch.Tensor | None]]

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """Projection `proj` of layer `layer` mapped x [..., in] to y [..., out]: y plus each
        adapter's product on its rows (rows of no adapter unchanged)."""
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        for adapter, rows in self.groups:
            ab = adapter.layers[layer].get(proj)
            if ab is None:
                continue
            if rows is None:
                y2 = y2 + lora_product(x2, *ab)
            else:
                y2 = y2.index_add(0, rows, lora_product(x2.index_select(0, rows), *ab))
        return y2.view(y.shape)


class KvsLoRATerm(ctypes.Structure):
    """Mirror of `struct kvs_lora_term` in kernels/cpu/kvserve_forward.cpp."""

    _fields_ = [("A", ctypes.c_void_p), ("B", ctypes.c_void_p), ("r", ctypes.c_int32)]


def c_terms(batch: LoRABatch, num_rows: int, num_layers: int) -> tuple[ctypes.Array, torch.Tensor]:
    """The C whole-stack forward's view of a step's adapters: one term per (layer, projection,
    slot), and each row's slot (-1: the base)."""
    n = len(batch.groups)
    terms = (KvsLoRATerm * (num_layers * len(PROJECTIONS) * n))()
    row_slot = torch.full((num_rows,), -1, dtype=torch.int32)
    for s, (adapter, rows) in enumerate(batch.groups):
        if rows is None:
            row_slot.fill_(s)
        else:
            row_slot[rows] = s
        for layer, fused in enumerate(adapter.layers[:num_layers]):
            for p, proj in enumerate(PROJECTIONS):
                ab = fused.get(proj)
                if ab is not None:
                    bt = adapter.extra.get((layer, proj))
                    if bt is None:   # the C loop reads B transposed, [r, out]
                        bt = adapter.extra[(layer, proj)] = ab[1].t().contiguous()
                    terms[(layer * len(PROJECTIONS) + p) * n + s] = KvsLoRATerm(ab[0].data_ptr(), bt.data_ptr(),
                                                                             ab[0].shape[0])
    return terms, row_slot


def lora_product(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """(x A^T) B^T row by row: x [n, in] -> [n, out]; each row's arithmetic is that of a lone row."""
    n = x.shape[0]
    t = torch.bmm(x.unsqueeze(1), A.t().expand(n, *A.t().shape))
    return torch.bmm(t, B.t().expand(n, *B.t().shape)).squeeze(1)


def parse_targets(spec: str | list[str] | None) -> list[str]:
    """'q,k,v,o' or HF names -> HF module names (default: every projection)."""
    if spec is None or spec == "" or spec == "all":
        return list(MODULES)
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for s in (i.strip() for i in items):
        m = SHORT.get(s, s)
        if m not in MODULES:
            raise InvalidRequest(f"unknown LoRA target {s!r}: choose from q,k,v,o,gate,up,down", param="lora_targets")
        if m not in out:
            out.append(m)
    return out
