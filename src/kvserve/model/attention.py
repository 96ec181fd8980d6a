"""Attention over the paged KV cache.

The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]:
K and V, each a pool of fixed-size blocks. A sequence owns a block table, the list of block
ids holding its tokens in order, so token t of the sequence lives in block
block_table[t // block_size] at offset t % block_size, that is at flat slot
block_table[t // block_size] * block_size + t % block_size:

    block_table = [7, 2, 9]          block_size = 4, seq_len = 10
    tokens 0-3 -> block 7, tokens 4-7 -> block 2, tokens 8-9 -> block 9 (2 free slots)

A step's batch is flattened: sequence i contributes query tokens
[query_start_loc[i], query_start_loc[i+1]), which are its last q_len_i tokens, so it attends to
its first seq_lens[i] tokens with a causal mask aligned bottom-right. New K/V are written to
`slot_mapping` first, then read back through the block table: attention reads the pool
directly, no contiguous per-request copy is kept between steps.

An int8 cache (model/kv_quant.py) has rows of head_dim + 2: the values and their own fp16 scale;
rows are quantized as they are written and widened to float where they are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvserve.model.kv_quant import quantize_rows, to_compute

if TYPE_CHECKING:
    from kvserve.model.kernels.backend import KernelBackend


@dataclass
class AttentionMetadata:
    query_start_loc: list[int]      # B+1 offsets into the flattened batch
    seq_lens: list[int]             # B: tokens in context after this step (cached + new)
    slot_mapping: torch.Tensor      # [T] int64 flat slot of each new token
    block_tables: torch.Tensor      # [B, max_blocks] int64, padded with 0
    block_size: int
    local: AttentionMetadata | None = None   # the sliding layers' slots and tables (own pool), if any

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_all_decode(self) -> bool:
        return self.query_start_loc[-1] == self.num_seqs

    @staticmethod
    def layout(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
               block_size: int) -> tuple[list[int], list[int], list[int], int]:
        """As plain lists: query offsets, each new token's flat slot, the block tables padded with 0
        to one width (rows concatenated), and that width."""
        qsl = [0]
        slots: list[int] = []
        for q, s, bt in zip(query_lens, seq_lens, block_tables):
            qsl.append(qsl[-1] + q)
            for pos in range(s - q, s):
                slots.append(bt[pos // block_size] * block_size + pos % block_size)
        width = max((len(bt) for bt in block_tables), default=0)
        return qsl, slots, [x for bt in block_tables for x in list(bt) + [0] * (width - len(bt))], width

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """Derive query offsets, slot mapping and the padded block-table tensor."""
        qsl, slots, table, width = cls.layout(query_lens, seq_lens, block_tables, block_size)
        # one tensor from the padded lists (a zeros table filled row by row made a tensor per row)
        table = torch.tensor(table, dtype=torch.long).view(len(block_tables), width)
        return cls(qsl, list(seq_lens), torch.tensor(slots, dtype=torch.long, device=device),
                   table.to(device), block_size)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, Hkv, D] at their slots."""
    _, nb, bs, h, d = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, h, d)
    if kv_cache.dtype == torch.int8:
        k, v = quantize_rows(k), quantize_rows(v)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first n tokens, [n, Hkv, D] (an int8 cache's rows widened to fp32)."""
    bs = kv_cache.shape[2]
    blocks = block_table[: (n + bs - 1) // bs]
    k = kv_cache[0, blocks].flatten(0, 1)[:n]
    v = kv_cache[1, blocks].flatten(0, 1)[:n]
    if kv_cache.dtype == torch.int8:
        return to_compute(k, torch.float32), to_compute(v, torch.float32)
    return k, v


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, backend: KernelBackend | None = None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q [T, Hq, D] (already rotated) -> output [T, Hq, D]; K/V for these tokens already written.
    A backend with C kernels serves all-decode steps with its decode kernel (K/V read in place).
    window: each query sees its last `window` positions (itself included); only the blocks that
    hold them are read (earlier ones may have been freed). softcap: scores -> softcap*tanh(s/softcap)."""
    if window is not None or softcap is not None:
        return _windowed(q, kv_cache, meta, scale, window, softcap)
    if backend is not None and meta.is_all_decode:
        out = backend.paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale)
        if out is not None:
            return out
    hq, d = q.shape[1], q.shape[2]
    hkv = kv_cache.shape[3]
    gqa = hq != hkv
    dtype = q.dtype
    if meta.is_all_decode and meta.num_seqs > 1:
        # One padded SDPA call for a batch of single-token queries.
        b = meta.num_seqs
        max_len = max(meta.seq_lens)
        bs = meta.block_size
        nblk = (max_len + bs - 1) // bs
        tables = meta.block_tables[:, :nblk]
        k = to_compute(kv_cache[0, tables].flatten(1, 2)[:, :max_len], dtype)    # [B, L, Hkv, D]
        v = to_compute(kv_cache[1, tables].flatten(1, 2)[:, :max_len], dtype)
        lens = torch.tensor(meta.seq_lens, device=k.device)
        mask = torch.arange(max_len, device=k.device)[None, :] < lens[:, None]    # [B, L]
        # Padding slots were never written (the pool is torch.empty): they may hold NaN/Inf,
        # which a masked score does not stop (0 * NaN = NaN in the weighted sum of V). Zero them.
        invalid = ~mask[:, :, None, None]
        k.masked_fill_(invalid, 0.0)
        v.masked_fill_(invalid, 0.0)
        out = F.scaled_dot_product_attention(
            q.view(b, 1, hq, d).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(b, hq, d)
    outs = []
    for i in range(meta.num_seqs):
        s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        n = meta.seq_lens[i]
        k, v = gather_kv(kv_cache, meta.block_tables[i], n)
        outs.append(attend(q[s:e], k.to(dtype), v.to(dtype), scale))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _windowed(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
              window: int | None, softcap: float | None) -> torch.Tensor:
    """Per sequence, over the blocks from the one holding its first query's window start."""
    bs, dtype = meta.block_size, q.dtype
    outs = []
    for i in range(meta.num_seqs):
        s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        n = meta.seq_lens[i]
        first = 0 if window is None else max(0, n - (e - s) - window + 1) // bs
        blocks = meta.block_tables[i, first:(n + bs - 1) // bs]
        k = to_compute(kv_cache[0, blocks].flatten(0, 1)[:n - first * bs], dtype)
        v = to_compute(kv_cache[1, blocks].flatten(0, 1)[:n - first * bs], dtype)
        outs.append(attend(q[s:e], k, v, scale, window, softcap))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the last len(q) positions over len(k) keys. q [Lq, Hq, D], k/v [Lk, Hkv, D].
    window/softcap: see paged_attention."""
    lq, lk = q.shape[0], k.shape[0]
    gqa = q.shape[1] != k.shape[1]
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if window is not None or softcap is not None:
        qpos = torch.arange(lk - lq, lk, device=q.device)[:, None]
        kpos = torch.arange(lk, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= qpos - kpos < window
        if softcap is None:
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
            return out.transpose(0, 1)
        rep = q.shape[1] // k.shape[1]
        kt, vt = kt.repeat_interleave(rep, dim=0), vt.repeat_interleave(rep, dim=0)
        scores = torch.matmul(qt, kt.transpose(1, 2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.matmul(probs, vt).transpose(0, 1)
    if lq == 1:
        out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=gqa)
    elif lq == lk:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:  # a chunk of a prompt whose earlier part is cached: causal mask aligned bottom-right
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1)
