"""What a loaded model costs before and while it decodes: time to ready, RSS, bytes read per
decode token and the share of this machine's memory bandwidth that decode reaches.

Decode at batch 1 reads every projection's weights once per token (the embedding only one row,
the LM head all of it) plus the KV cache of the context so far; a token cannot come faster than
those bytes can stream from memory. The roofline is that bound: measured bandwidth / bytes per
token. Bandwidth is measured once per run with a large torch copy (bytes read + bytes written over
the best time, the threads the benchmark uses), the figure a streaming kernel could reach here.

RSS is this process's, the bench harness's own imports included (a few MB: the CLI's, as a `kvserve
run` holds them), read at ready (load and a one-token forward) and again after the measured runs,
when prefill scratch, the KV cache and the embedding rows the prompts read are in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


def rss() -> dict[str, int]:
    """This process's VmRSS, RssAnon and RssFile in bytes (/proc/self/status; empty elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                    if line.startswith(("VmRSS", "RssAnon", "RssFile"))}
    except OSError:
        return {}


def measure_bandwidth(mb: int = 256, repeats: int = 5) -> float:
    """Copy bandwidth in bytes/s (read + write), best of `repeats` copies of `mb` MB."""
    src = torch.ones(mb << 18, dtype=torch.float32)        # mb MB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a batch-1 decode step reads: every projection of every layer, the final
    norm and the LM head whole; of the embedding table one row."""
    def nbytes(mod) -> int:
        ts = [getattr(mod, n, None) for n in ("qs", "d", "m", "weight", "bias")]
        return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))

    total = 0
    for layer in model.layers:
        total += sum(nbytes(m) for m in layer.modules() if m is not layer)
    total += nbytes(model.norm) + nbytes(model.lm_head)
    emb = model.embed_tokens if model.embed_tokens is not None else model.packed_embed   # None: tied
    if emb is not None and emb is not getattr(model.lm_head, "weight", None):
        size = nbytes(emb) if isinstance(emb, torch.nn.Module) else emb.numel() * emb.element_size()
        total += size // max(1, model.config.vocab_size)
    return total


def kv_bytes_per_token(config, context: int, kv_dtype: torch.dtype) -> int:
    """KV cache bytes one decode step reads at `context` tokens of context."""
    per_pos = 2 * config.num_key_value_heads * config.head_dim * torch.empty(0, dtype=kv_dtype).element_size()
    return config.num_hidden_layers * per_pos * context


@dataclass
class Footprint:
    ready_s: float          # load_model + the first one-token forward
    rss: dict[str, int]     # after that
    file_bytes: int         # the model file (0 for a directory)
    weight_bytes: int       # read per decode token
    kv_bytes: int           # read per decode token, at the mean context of the decode run
    bandwidth: float        # bytes/s, measured
    rss_end: dict[str, int] = field(default_factory=dict)   # after the measured runs (prefills, decodes)

    def row(self, decode_tps: float) -> dict:
        per_token = self.weight_bytes + self.kv_bytes
        roofline = self.bandwidth / per_token
        return {"ready_s": self.ready_s, "rss_mb": self.rss.get("VmRSS", 0) / 2**20,
                "rss_file_mb": self.rss.get("RssFile", 0) / 2**20, "file_mb": self.file_bytes / 2**20,
                "rss_end_mb": self.rss_end.get("VmRSS", 0) / 2**20, "rss_end_file_mb": self.rss_end.get("RssFile", 0) / 2**20,
                "mb_per_token": per_token / 2**20, "bandwidth_gbs": self.bandwidth / 1e9,
                "roofline_tps": roofline, "decode_tps": decode_tps, "roofline_share": decode_tps / roofline}


def footprint_table(rows: list[dict]) -> str:
    lines = [("| engine | ready s | RSS MB (file-backed) | after the runs | file MB | MB read/token | bandwidth GB/s | "
              "roofline tok/s | decode tok/s | share |"), "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['ready_s']:.2f} | {r['rss_mb']:.0f} ({r['rss_file_mb']:.0f}) | "
                     f"{r.get('rss_end_mb', 0):.0f} ({r.get('rss_end_file_mb', 0):.0f}) | {r['file_mb']:.0f} | {r['mb_per_token']:.1f} | {r['bandwidth_gbs']:.1f} | "
                     f"{r['roofline_tps']:.1f} | {r['decode_tps']:.1f} | {r['roofline_share']:.0%} |")
    return "\n".join(lines)


def measure(runner, ready_s: float, cfg) -> Footprint:
    """The footprint of a bench latency KvserveRunner just loaded and run once."""
    from pathlib import Path

    path = runner.loaded.source.path
    file_bytes = Path(path).stat().st_size if path and Path(path).is_file() else 0
    context = cfg.prompt_tokens + cfg.decode_tokens // 2
    return Footprint(ready_s, rss(), file_bytes, weight_bytes_per_token(runner.model),
                     kv_bytes_per_token(runner.loaded.config, context, runner.kv_caches[0].dtype), measure_bandwidth())
