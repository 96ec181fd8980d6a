"""Disaggregated prefill and decode: the KV blocks of a prompt move from a prefill replica to a
decode replica, which lands them in its prefix cache and continues from there.

    gateway ──prefill(request, max_tokens=1)──▶ prefill replica: computes the prompt; when the
                                                request finishes (the same step) its full blocks
                                                are still in the prefix cache: they are exported
    prefill replica ──KV payload (Ray object store)──▶ decode replica: each block is written into
                                                a free block and registered under its hash, as if
                                                this replica had computed it
    gateway ──the request itself──▶ decode replica: admitted with a prefix-cache hit on every
                                                imported block; it computes the last partial block
                                                (at most block_size tokens) and decodes

The prefix cache is the landing spot, so nothing in the scheduler changes and a request whose
payload is missing or does not fit (an error, another KV dtype, a full pool) simply computes its
prompt on the decode replica. Greedy output is the colocated output token for token: the imported
blocks hold the bytes the decode replica would have computed (a row's arithmetic does not depend
on the batch, the chunking or the cache; docs/architecture.md, Kernels).

The payload is bytes: a 4-byte little-endian length, a msgpack header, then the blocks' raw tensor
bytes [layers, 2, blocks, block_size, kv_heads, head_dim] in the cache's dtype. Never pickle.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable

import msgspec

from kvserve.engine.messages import CoreInput, EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger("kvserve.engine")


class KVHeader(msgspec.Struct, kw_only=True):
    version: int = 1
    request_id: str
    block_size: int = 0
    dtype: str = ""
    shape: list[int] = []             # [layers, 2, blocks, block_size, kv_heads, head_dim]
    hashes: list[bytes] = []          # the KV cache manager's chained hash of each block
    prefill_seconds: float = 0.0      # submit -> export on the prefill replica
    error: str | None = None


class ImportKV(msgspec.Struct):
    """A decoded payload, queued to the decode replica's core thread ahead of its request."""

    header: KVHeader
    data: bytes


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(KVHeader)


def encode_payload(header: KVHeader, data: bytes = b"") -> bytes:
    h = _header_encoder.encode(header)
    return struct.pack("<I", len(h)) + h + data


def decode_payload(payload: bytes) -> ImportKV:
    (n,) = struct.unpack_from("<I", payload)
    return ImportKV(_header_decoder.decode(payload[4:4 + n]), payload[4 + n:])


def prompt_block_hashes(kv, req: EngineCoreRequest, num_blocks: int) -> list[bytes]:
    """The KV cache manager's hashes of the prompt's first num_blocks blocks (same chain, salt)."""
    bs, ids, out = kv.block_size, req.prompt_token_ids, []
    for i in range(num_blocks):
        salt = req.cache_salt if (i + 1) * bs > req.cache_salt_from else None
        out.append(kv._hash(out[-1] if out else None, ids[i * bs:(i + 1) * bs], salt))
    return out


class KVTransfer:
    """A replica's side of the transfer: `role` is "prefill" (export) or "decode" (import)."""

    def __init__(self, core, role: str):
        if role not in ("prefill", "decode"):
            raise ValueError(f"unknown disaggregation role {role!r}")
        self.core, self.role = core, role
        self._pending: dict[str, tuple[EngineCoreRequest, float, threading.Event, list[bytes]]] = {}
        self._lock = threading.Lock()
        self.exported_blocks = 0
        self.imported_blocks = 0

    # ---- prefill side ---------------------------------------------------------------------
    def prefill(self, req: EngineCoreRequest, submit: Callable[[EngineCoreRequest], None],
                timeout: float = 600) -> bytes:
        """Run req (max_tokens should be 1) and return its prompt's KV payload (blocking)."""
        ev, box = threading.Event(), []
        with self._lock:
            self._pending[req.request_id] = (req, time.perf_counter(), ev, box)
        submit(req)
        if not ev.wait(timeout):
            with self._lock:
                self._pending.pop(req.request_id, None)
            return encode_payload(KVHeader(request_id=req.request_id, error="prefill timed out"))
        return box[0]

    def wrap_emit(self, emit: Callable[[EngineCoreOutputs], None]) -> Callable[[EngineCoreOutputs], None]:
        """On the core's thread, right after a step and before the next: export the prompts of the
        requests that finished in it (their blocks are freed but still hold their contents)."""
        if self.role != "prefill":
            return emit

        def wrapped(outs: EngineCoreOutputs) -> None:
            for o in outs.outputs:
                if o.finish_reason is None:
                    continue
                with self._lock:
                    entry = self._pending.pop(o.request_id, None)
                if entry is not None:
                    req, t0, ev, box = entry
                    err = o.error or (None if o.finish_reason in ("length", "stop") else o.finish_reason)
                    box.append(self._export(req, time.perf_counter() - t0, err))
                    ev.set()
            emit(outs)
        return wrapped

    def _export(self, req: EngineCoreRequest, seconds: float, error: str | None) -> bytes:
        import torch

        kv, caches = self.core.kv, self.core.runner.kv_caches
        header = KVHeader(request_id=req.request_id, block_size=kv.block_size, prefill_seconds=seconds, error=error)
        if error is not None or not hasattr(kv, "cached"):   # (a pool per layer type: not exported)
            return encode_payload(header)
        hashes = prompt_block_hashes(kv, req, (len(req.prompt_token_ids) - 1) // kv.block_size)
        blocks = []
        for h in hashes:
            b = kv.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        hashes = hashes[:len(blocks)]
        if not blocks:
            return encode_payload(header)
        idx = torch.tensor(blocks, dtype=torch.long, device=caches[0].device)
        data = torch.stack([c.index_select(1, idx) for c in caches]).cpu().contiguous()
        header.dtype, header.shape, header.hashes = str(data.dtype).removeprefix("torch."), list(data.shape), hashes
        self.exported_blocks += len(blocks)
        return encode_payload(header, data.view(torch.uint8).numpy().tobytes())

    # ---- decode side ----------------------------------------------------------------------
    def decode_payload(self, payload: bytes) -> ImportKV:
        return decode_payload(payload)

    def on_inputs(self, msgs: list) -> list[CoreInput]:
        """On the core's thread: land each ImportKV in the prefix cache, pass the rest on."""
        out = []
        for m in msgs:
            if isinstance(m, ImportKV):
                try:
                    self._import(m)
                except Exception:   # the request then computes its own prompt
                    logger.exception("could not import KV blocks for %s", m.header.request_id)
            else:
                out.append(m)
        return out

    def _import(self, m: ImportKV) -> None:
        import torch

        h, kv, caches = m.header, self.core.kv, self.core.runner.kv_caches
        if h.error is not None or not h.hashes or not hasattr(kv, "cached"):
            return
        local = caches[0]
        want = [len(caches), 2, len(h.hashes), kv.block_size, local.shape[3], local.shape[4]]
        if h.block_size != kv.block_size or h.shape != want or h.dtype != str(local.dtype).removeprefix("torch."):
            logger.warning("KV payload for %s does not fit this replica (%s %s vs %s %s): computing it here",
                           h.request_id, h.dtype, h.shape, local.dtype, want)
            return
        data = torch.frombuffer(bytearray(m.data), dtype=torch.uint8).view(local.dtype).view(want)
        for j, bh in enumerate(h.hashes):
            if bh in kv.cached:
                continue
            if not kv.free_queue:
                break
            b, _ = kv.free_queue.popitem(last=False)       # least recently freed: evict its contents
            old = kv.block_hash[b]
            if old is not None and kv.cached.get(old) == b:
                del kv.cached[old]
            for layer, c in enumerate(caches):
                c[:, b] = data[layer, :, j].to(c.device)
            kv.block_hash[b] = bh
            kv.cached[bh] = b
            kv.free_queue[b] = None                         # free and cached, most recently used
            self.imported_blocks += 1
