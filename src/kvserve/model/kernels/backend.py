"""KernelBackend: which kernels a model runs, decided once when it is loaded.

`KernelBackend.detect()` reads the CPU's features and the `KVSERVE_*` switches (the only place
they are read), compiles or finds the C library, and logs one line saying what it chose:

    kvserve kernels: isa=avx512 (avx2 fma avx512f ...), batch-invariant: int8 kernels for every
    step size, C attention for every query, whole-stack C forward for every step

Batch invariance (the default, KVSERVE_BATCH_INVARIANT=1): a request's logits are bitwise the
same whatever else is in its step, however its prompt was chunked and whether it hit the prefix
cache. Every packed projection then runs the int8 kernels for every token count (their arithmetic
for one output never depends on the others: see cpu/kvserve_kernels.cpp) and every query token
attends in C over its own prefix. KVSERVE_BATCH_INVARIANT=0 restores the switch points below
(bf16 oneDNN or fp32 MKL for large calls, PyTorch SDPA for long prompt chunks), whose numbers
depend on the step's size.

The backend is then handed to everything that picks a path per call (every GGUFQuantLinear, the
model and its layer ops, paged attention), so no module keeps a global kernel setting and nothing
below load time looks at the environment. Tests make variants with `dataclasses.replace`.

ISA levels, lowest first, and what each adds for us:
  torch   no C kernels (another device, no compiler, a CPU without AVX2, KVSERVE_NO_KERNELS)
  avx2    the int8 kernels (avx2 fma f16c); large calls dequantize into fp32 and use MKL
  avx512  avx512f/bw/vl/dq: prompt tiles' attention in 512-bit registers (same bits), and what
          oneDNN needs for bf16 matmuls; with avx512_vnni, the int8 tiles' VNNI build
  amx     AMX tiles: the int8 kernels run steps of 16 tokens and more on AMX-INT8 (amx_int8, same
          bits); with batch invariance off, large calls use a prepacked bf16 copy through oneDNN
KVSERVE_ISA=avx2|avx512|amx forces a lower level than the CPU's: its features are then cut to
that level's baseline, so the build and every path are those of a CPU that has only that.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kvserve.model.kernels import build
from kvserve.model.ops import TorchOps

logger = logging.getLogger(__name__)

ISA_LEVELS = ("torch", "avx2", "avx512", "amx")
# Flags each level needs on top of the one below, and the optional ones it may bring along.
_REQUIRED = {"torch": (), "avx2": build.REQUIRED_CPU_FLAGS,
             "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"), "amx": ("amx_tile", "amx_bf16")}
_OPTIONAL = {"torch": (), "avx2": (), "avx512": ("avx_vnni", "avx512_vnni", "avx512_bf16"), "amx": ("amx_int8",)}
_SHOWN = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
          "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
# Without a bf16/fp32 GEMM switch point every step takes the one-call forward (its int8 GEMM and
# tiled attention are the per-layer path's, bit for bit, with no Python between the layers).
UNLIMITED_TOKENS = 1 << 30
# With batch invariance off, a sequence with more query tokens than this in a step attends by SDPA.
ATTN_C_MAX_QUERY = 16


def isa_of(features: set[str] | frozenset[str]) -> str:
    """The highest ISA level whose flags (and every lower level's) are all in `features`."""
    level = "torch"
    for name in ISA_LEVELS[1:]:
        if not all(f in features for f in _REQUIRED[name]):
            break
        level = name
    return level


def features_up_to(isa: str, features: set[str] | frozenset[str]) -> frozenset[str]:
    """`features` cut to what a CPU of level `isa` has (its levels' required and optional flags)."""
    keep: set[str] = set()
    for name in ISA_LEVELS[: ISA_LEVELS.index(isa) + 1]:
        keep.update(_REQUIRED[name], _OPTIONAL[name])
    return frozenset(f for f in features if f in keep)


def _env_tokens(name: str, default: int | None) -> int | None:
    """An optional token-count switch: unset = default, 0 = off."""
    value = os.environ.get(name)
    return default if value is None else (int(value) or None)


def _torch_prepacks_bf16() -> bool:
    """This torch build has oneDNN's weight prepacking ops (torch.ops.mkldnn, CPU builds)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018 - resolving the op is the check
        torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


@dataclass
class KernelBackend:
    """The kernel choices of one loaded model. Fields:

    isa, features: the ISA level in use and the CPU flags it may rely on.
    device: where the model runs (a torch device string); anything but the CPU runs PyTorch only.
    lib: the loaded C library, or None (then `reason` says why) and every layer runs PyTorch.
    bf16_min_tokens: GGUFQuantLinear calls with at least this many tokens use a bf16 copy of the
      dequantized weights and oneDNN (AMX); None = no copy. Default 3 on amx (the crossover
      measured at T=2-4 on every model shape, BENCHMARKS.md), else None.
    f32_min_tokens: where there is no bf16 copy, calls with at least this many tokens dequantize
      into this backend's fp32 scratch (~0.1 ms per MB of packed weights) and run torch's fp32
      GEMM (MKL), ~3x the int8 kernel at T=512. Default 32 without the bf16 path, else None.
    fused_forward: the layers' glue (norms, RoPE + KV write + attention, SwiGLU) runs in C, and
      steps of up to `max_fused_tokens` run the whole layer stack in one C call.
    fused_max_tokens: overrides that bound (None: just below the projections' GEMM switch).
    bf16_prepack: bf16 copies are prepacked for oneDNN (torch has the ops and the ISA level is
      avx512 or up; oneDNN refuses bf16 prepacking on AVX2-only CPUs).
    attn_c_max_query: a sequence with more query tokens than this in a step attends through
      PyTorch's SDPA (a GEMM per head, faster for long chunks, but its numbers depend on the
      chunk); None = every query token attends in C (batch-invariant).
    """

    isa: str = "torch"
    features: frozenset[str] = frozenset()
    device: str = "cpu"
    lib: ctypes.CDLL | None = None
    reason: str = "PyTorch only"
    bf16_min_tokens: int | None = None
    f32_min_tokens: int | None = None
    fused_forward: bool = False
    fused_max_tokens: int | None = None
    bf16_prepack: bool = False
    attn_c_max_query: int | None = None
    _scratch: torch.Tensor = field(init=False, repr=False, compare=False)
    _scratch_lock: threading.Lock = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._scratch_lock = threading.Lock()

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def pytorch(cls, device: str | torch.device = "cpu") -> KernelBackend:
        """No C kernels: every path is PyTorch (the reference, and any non-CPU device)."""
        return cls(device=str(torch.device(device)))

    @classmethod
    def detect(cls, device: str | torch.device = "cpu", isa: str | None = None) -> KernelBackend:
        """The backend for this machine: CPU features, the C library, and the KVSERVE_* switches
        (KVSERVE_ISA, KVSERVE_NO_KERNELS, KVSERVE_BATCH_INVARIANT, KVSERVE_BF16_MIN_TOKENS,
        KVSERVE_F32_MIN_TOKENS, KVSERVE_FUSED_FORWARD, KVSERVE_ADAPTIVE_THREADS), read here and nowhere else. `isa` overrides KVSERVE_ISA.
        Logs one INFO line describing the choice."""
        device = str(torch.device(device))
        if torch.device(device).type != "cpu":
            backend = cls(device=device, reason=f"device {device}")
            logger.info("%s", backend.describe())
            return backend
        detected = frozenset(build.cpu_flags())
        level = isa_of(detected)
        features = detected
        wanted = isa or os.environ.get("KVSERVE_ISA") or None
        if wanted is not None:
            wanted = wanted.lower()
            if wanted not in ISA_LEVELS:
                raise ValueError(f"KVSERVE_ISA={wanted!r} is not one of {', '.join(ISA_LEVELS)}")
            if ISA_LEVELS.index(wanted) > ISA_LEVELS.index(level):
                logger.warning("kvserve kernels: isa=%s requested but this CPU is %s; using %s", wanted, level, level)
            else:
                level, features = wanted, features_up_to(wanted, detected)
        lib, reason = None, ""
        if os.environ.get("KVSERVE_NO_KERNELS"):
            reason = "disabled by KVSERVE_NO_KERNELS"
        elif level == "torch":
            reason = "isa=torch requested" if wanted == "torch" else (
                f"CPU lacks one of {', '.join(build.REQUIRED_CPU_FLAGS)}")
        else:
            try:
                lib = build.load(features)
            except Exception as e:  # noqa: BLE001 - any failure means: run the PyTorch paths
                reason = str(e).splitlines()[0]
        if lib is None:
            logger.warning("kvserve: fast CPU kernels unavailable (%s); using slower PyTorch matmul", reason)
            backend = cls(isa="torch", features=features, reason=reason)
        else:
            invariant = os.environ.get("KVSERVE_BATCH_INVARIANT", "1") != "0"
            bf16 = _env_tokens("KVSERVE_BF16_MIN_TOKENS", None if invariant or level != "amx" else 3)
            f32 = _env_tokens("KVSERVE_F32_MIN_TOKENS", None if invariant or bf16 is not None else 32)
            fused = os.environ.get("KVSERVE_FUSED_FORWARD", "1") != "0"
            # fewer threads while another process holds a core (cpu/kvserve_forward.cpp: team size)
            lib.kvs_set_adaptive_threads(int(os.environ.get("KVSERVE_ADAPTIVE_THREADS", "1") != "0"))
            prepack = ISA_LEVELS.index(level) >= ISA_LEVELS.index("avx512") and _torch_prepacks_bf16()
            backend = cls(isa=level, features=features, lib=lib, reason="", bf16_min_tokens=bf16,
                          f32_min_tokens=f32, fused_forward=fused, bf16_prepack=prepack,
                          attn_c_max_query=None if invariant else ATTN_C_MAX_QUERY)
        logger.info("%s", backend.describe())
        return backend

    # ---- what it does -------------------------------------------------------------------
    @property
    def batch_invariant(self) -> bool:
        """Every step size and chunking gives a request the same numbers (one kernel per call
        size, C attention for every query). PyTorch-only backends are not: torch's matmul picks
        its kernel by shape."""
        return (self.lib is not None and self.bf16_min_tokens is None and self.f32_min_tokens is None
                and self.attn_c_max_query is None)

    @property
    def gemm_isa(self) -> int:
        """The int8 tiles packed weights run (their descriptors' isa): 2 = AMX-INT8 for steps of 16
        tokens and more (VNNI below) where the level is amx, the CPU has amx_int8 and Linux grants the
        tile state; 1 = AVX-512 VNNI where the level and features allow it; else 0 = AVX2. All give
        identical results."""
        if ISA_LEVELS.index(self.isa) < ISA_LEVELS.index("avx512") or "avx512_vnni" not in self.features:
            return 0
        if self.isa == "amx" and "amx_int8" in self.features and self.lib is not None and self.lib.kvs_amx_init():
            return 2
        return 1

    @property
    def attn_isa(self) -> int:
        """The prompt tiles' attention build: 1 = AVX-512 (avx512 level or up), 0 = AVX2; the same bits."""
        return 1 if ISA_LEVELS.index(self.isa) >= ISA_LEVELS.index("avx512") else 0

    @property
    def max_fused_tokens(self) -> int:
        """Steps of up to this many tokens run the whole layer stack in one C call (packed weights)."""
        if not self.fused_forward or self.lib is None:
            return 0
        if self.fused_max_tokens is not None:
            return self.fused_max_tokens
        points = [p for p in (self.bf16_min_tokens, self.f32_min_tokens) if p is not None]
        return min(points) - 1 if points else UNLIMITED_TOKENS

    def __deepcopy__(self, memo: dict) -> KernelBackend:
        """Shared, not copied: a copied model (a DPO/GRPO reference) runs on the same kernels."""
        return self

    def sync_torch_threads(self) -> None:
        """torch's intra-op threads (sampling, the odd torch op of a step) follow the kernels' team:
        fewer while another process holds a core (cpu/kvserve_forward.cpp), all of them again after.
        A ctypes call and a comparison per step; torch.set_num_threads only when the team changed."""
        if self.lib is None:
            return
        n = self.lib.kvs_team_threads() or self.lib.kvs_get_num_threads()
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def describe(self) -> str:
        """The one log line: ISA, features, and which path serves which step size."""
        shown = " ".join(f for f in _SHOWN if f in self.features)
        head = f"kvserve kernels: isa={self.isa}" + (f" ({shown})" if shown else "")
        if self.lib is None:
            return f"{head}, PyTorch only on {self.device} ({self.reason})"
        big = ("bf16 oneDNN", self.bf16_min_tokens) if self.bf16_min_tokens else ("fp32 MKL GEMM", self.f32_min_tokens)
        paths = (f"int8 kernels below {big[1]} tokens, {big[0]} from {big[1]}" if big[1]
                 else "int8 kernels for every step size")
        attn = ("C attention for every query" if self.attn_c_max_query is None
                else f"C attention up to {self.attn_c_max_query} query tokens, SDPA above")
        n = self.max_fused_tokens
        fused = (", PyTorch glue between projections" if not self.fused_forward
                 else ", whole-stack C forward for every step" if n >= UNLIMITED_TOKENS
                 else f", whole-stack C forward up to {n} tokens, C glue above")
        mode = "batch-invariant" if self.batch_invariant else "batch-dependent numerics"
        return f"{head}, {mode}: {paths}, {attn}{fused}"

    def slow_paths(self, model: torch.nn.Module) -> list[str]:
        """What of `model` runs off the fast path on this backend, and why, one phrase each (e.g.
        "layer 3 MLP down on the reference path: Q5_0 weights are not packed"); empty when every
        layer runs the whole-stack C forward and the LM head the int8 kernels."""
        cfg = model.config
        if self.lib is None:
            return [f"every layer on the PyTorch path: {self.reason}"]
        if not cfg.c_layer_ops:
            return [f"every layer on the reference path: {_family_features(cfg)}"]
        if not self.fused_forward:
            return ["every layer on the reference path: the C forward is off (KVSERVE_FUSED_FORWARD=0)"]
        from kvserve.model.kernels.cpu_ops import CpuOps, is_int8

        first, n = model.layers[0], len(model.layers)
        if not CpuOps.suits(model):
            why = (f"head_dim {first.head_dim} is odd" if first.head_dim % 2 else
                   f"{first.num_heads} heads are not a multiple of {first.num_kv_heads} KV heads")
            return [f"every layer on the reference path: {why}"]
        out: list[str] = []
        groups: dict[str, list[int]] = {}
        for i, layer in enumerate(model.layers):
            if layer.mlp is not None:
                groups.setdefault(f"MLP in PyTorch: {cfg.num_experts} experts", []).append(i)
            for attr, what in _PROJECTIONS.items():
                lin = getattr(layer, attr)
                if lin is not None and not is_int8(lin):
                    groups.setdefault(f"{what} on the reference path: {_unpacked(lin)}", []).append(i)
        out += [f"{_layer_list(idx, n)} {what}" for what, idx in groups.items()]
        if groups:
            out.append("so every step runs layer by layer (C glue between projections), not as one C call")
        if first.head_dim not in VECTOR_HEAD_DIMS:
            out.append(f"every layer's attention on the generic C loop: head_dim {first.head_dim} has no vector kernel")
        if not is_int8(model.lm_head):
            out.append(f"LM head on the reference path: {_unpacked(model.lm_head)}")
        return out

    def describe_model(self, model: torch.nn.Module) -> str:
        """The start-up line of a loaded model: its shape, and the fast path or what is off it."""
        cfg = model.config
        first = model.layers[0] if len(model.layers) else None
        shape = [f"{len(model.layers)} layers", f"vocab {cfg.vocab_size}",
                 "tied head" if cfg.tie_word_embeddings else "untied head"]
        if first is not None:
            shape.insert(1, f"head_dim {first.head_dim}")
        if cfg.attention_bias:
            shape.append("q/k/v bias")
        if cfg.rope_scaling:
            shape.append(f"rope {cfg.rope_scaling.get('rope_type', cfg.rope_scaling.get('type'))}")
        head = f"kvserve model {cfg.name or cfg.architecture} ({', '.join(shape)})"
        slow = self.slow_paths(model) if first is not None else ["no layers"]
        if not slow:
            return f"{head}: every layer and the LM head on the fast path (whole-stack C forward, int8 kernels)"
        return f"{head}: " + "; ".join(slow)

    @contextmanager
    def f32_scratch(self, n: int) -> Iterator[torch.Tensor]:
        """This backend's reused fp32 buffer of n elements, held under its lock for the block."""
        with self._scratch_lock:
            if self._scratch.numel() < n:
                self._scratch = torch.empty(n, dtype=torch.float32)
            yield self._scratch[:n]

    def paged_decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: list[int], scale: float) -> torch.Tensor | None:
        """The C decode attention (see cpu_ops.paged_decode_attention), or None where it does not apply."""
        if self.lib is None:
            return None
        from kvserve.model.kernels.cpu_ops import paged_decode_attention

        return paged_decode_attention(self.lib, q, kv_cache, block_tables, seq_lens, scale)

    def layer_ops(self, model: torch.nn.Module) -> TorchOps:
        """The ops between a model's projections: the C glue when this backend has it and the
        model's shapes suit it, else PyTorch."""
        if self.fused_forward and self.lib is not None and len(model.layers):
            from kvserve.model.kernels.cpu_ops import CpuOps

            if CpuOps.suits(model):
                return CpuOps(model, self)
        return TorchOps(model.rotary, self, model.rotary_local)


# Head sizes cpu/kvserve_attention.cpp has vector code for (attend_rows / tile_rows: D / 8 lanes).
VECTOR_HEAD_DIMS = (32, 64, 80, 96, 128, 256)
_PROJECTIONS = {"qkv_proj": "attention QKV", "o_proj": "attention output", "gate_up_proj": "MLP gate/up",
                "down_proj": "MLP down"}


def _unpacked(lin: torch.nn.Module) -> str:
    """Why a projection is not on the int8 kernels: its weights' format (model.decoder records it)."""
    return f"{getattr(lin, 'source_format', 'dense')} weights are not packed (fp32 matmul)"


def _layer_list(idx: list[int], n: int) -> str:
    if len(idx) == n:
        return "every layer's"
    if len(idx) == 1:
        return f"layer {idx[0]}"
    runs: list[str] = []
    start = prev = idx[0]
    for i in [*idx[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return "layers " + ", ".join(runs)


def _family_features(cfg) -> str:
    """The family feature(s) that keep a model off the C layer ops (config.c_layer_ops)."""
    feats = [name for name, on in (
        ("q/k norm", cfg.qk_norm), ("Gemma norms", cfg.gemma_norms), ("sliding-window layers",
         "sliding_attention" in cfg.layer_types), ("attention soft-capping", cfg.attn_logit_softcapping),
        ("final soft-capping", cfg.final_logit_softcapping), ("query_pre_attn_scalar", cfg.query_pre_attn_scalar)) if on]
    return ", ".join(feats) or f"the {cfg.architecture} architecture"
