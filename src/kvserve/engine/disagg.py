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

The same payload moves a prefix between two serving replicas that share no disk store (two
machines): the gateway routes a request to replica B while replica A holds a longer prefix of it,
asks A to export that prefix (`export_prefix`: the blocks in A's RAM, then those on its disk tier,
copied between two of A's steps) and hands the payload to B with the request. The importer takes
a block only if the header's model hash, dtype and shape are its own, the checksum holds and its
hash is the one the importer computes for that block of the request itself: anything else is a
miss (the replica computes it), never a wrong token.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

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
    model_hash: str = ""              # the exporter's model content hash (kv_offload.model_fingerprint)
    checksum: int = 0                 # crc32 of the raw bytes


class ImportKV(msgspec.Struct):
    """A decoded payload, queued to the importing replica's core thread with the requests that
    continue from it (one queue item: the blocks land before the requests are admitted)."""

    header: KVHeader
    data: bytes
    requests: list = []


@dataclass
class ExportKV:
    """An on-demand export (`KVTransfer.export_prefix`), queued to the core's thread: the blocks of
    the request's first `max_blocks` that this replica holds, answered in `box`."""

    request: EngineCoreRequest
    max_blocks: int
    done: threading.Event = field(default_factory=threading.Event)
    box: list = field(default_factory=list)


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
    """A replica's side of the transfer: `role` is "prefill" (exports each prompt it ran), "decode"
    or "serve" (imports; every role exports a prefix on demand)."""

    def __init__(self, core, role: str):
        if role not in ("prefill", "decode", "serve"):
            raise ValueError(f"unknown disaggregation role {role!r}")
        self.core, self.role = core, role
        self._pending: dict[str, tuple[EngineCoreRequest, float, threading.Event, list[bytes]]] = {}
        self._lock = threading.Lock()
        self.exported_blocks = 0
        self.imported_blocks = 0
        self.rejected_blocks = 0        # a payload's blocks not landed: another model or format, a bad checksum
        self._model_hash: list[str] = []
        offload = getattr(core, "offload", None)
        if offload is not None:
            self._model_hash.append(offload.store.header.model_hash)
            self._hashing = None
        else:   # hashed beside the first steps, not before the replica is ready
            self._hashing = threading.Thread(target=self._hash_model, name="kv-model-hash", daemon=True)
            self._hashing.start()

    def _hash_model(self) -> None:
        from kvserve.engine.kv_offload import model_fingerprint

        self._model_hash.append(model_fingerprint(self.core.runner.model))

    def model_hash(self) -> str:
        if self._hashing is not None:
            self._hashing.join()
        return self._model_hash[0] if self._model_hash else ""

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
        kv = self.core.kv
        header = KVHeader(request_id=req.request_id, block_size=kv.block_size, prefill_seconds=seconds, error=error)
        if error is not None or not hasattr(kv, "cached"):   # (a pool per layer type: not exported)
            return encode_payload(header)
        hashes, data, _ = self._gather(req, (len(req.prompt_token_ids) - 1) // kv.block_size, disk=False)
        return self._payload(header, hashes, data)

    def _gather(self, req: EngineCoreRequest, max_blocks: int, disk: bool):
        """On the core's thread: (hashes, a copy [n, layers, 2, block_size, heads, width] of the
        blocks in RAM, the hashes that follow them on the disk tier)."""
        kv, runner = self.core.kv, self.core.runner
        hashes = prompt_block_hashes(kv, req, max_blocks)
        blocks = []
        for h in hashes:
            b = kv.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        on_disk = []
        store = self.core.offload.store if disk and self.core.offload is not None else None
        for h in hashes[len(blocks):] if store is not None and req.lora_name is None else ():
            if not store.has(h):
                break
            on_disk.append(h)
        return hashes[:len(blocks)], runner.read_blocks(blocks) if blocks else None, on_disk

    def _payload(self, header: KVHeader, hashes: list[bytes], data) -> bytes:
        """data: [n, layers, 2, block_size, heads, width] -> the payload's [layers, 2, n, ...]."""
        if data is None or not hashes:
            return encode_payload(header)
        import torch

        data = data.permute(1, 2, 0, 3, 4, 5).contiguous()
        raw = data.view(torch.uint8).numpy().tobytes()
        header.dtype, header.shape, header.hashes = str(data.dtype).removeprefix("torch."), list(data.shape), hashes
        header.model_hash, header.checksum = self.model_hash(), zlib.crc32(raw)
        self.exported_blocks += len(hashes)
        return encode_payload(header, raw)

    # ---- export on demand (another replica fetches a prefix) --------------------------------
    def export_prefix(self, req: EngineCoreRequest, max_blocks: int, submit: Callable[[ExportKV], None],
                      timeout: float = 15) -> bytes:
        """The payload of the longest prefix of req's first max_blocks blocks this replica holds in
        RAM and then on its disk tier (blocking; the RAM copy waits for a pause between two steps,
        the disk reads run on the caller's thread). An error or nothing held is an empty payload."""
        import torch

        kv = self.core.kv
        header = KVHeader(request_id=req.request_id, block_size=kv.block_size)
        if not hasattr(kv, "cached"):
            return encode_payload(header)
        job = ExportKV(req, max_blocks)
        submit(job)
        if not job.done.wait(timeout):
            header.error = "export timed out"
            return encode_payload(header)
        hashes, data, on_disk = job.box[0]
        if on_disk:
            off = self.core.offload
            blocks = []
            for h in on_disk:
                raw = off.store.read(h, off.shape, self.core.runner.kv_dtype_name)
                if raw is None:
                    break
                blocks.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            if blocks:
                dtype = self.core.runner.kv_caches[0].dtype
                read = torch.stack(blocks).view(dtype).view(-1, *off.shape)
                data = read if data is None else torch.cat([data, read])
                hashes = hashes + on_disk[:len(blocks)]
        return self._payload(header, hashes, data)

    # ---- import side ----------------------------------------------------------------------
    def decode_payload(self, payload: bytes) -> ImportKV:
        return decode_payload(payload)

    def on_inputs(self, msgs: list) -> list[CoreInput]:
        """On the core's thread: land each ImportKV in the prefix cache (then pass its requests
        on), answer each ExportKV, pass the rest on."""
        out = []
        for m in msgs:
            if isinstance(m, ImportKV):
                try:
                    self._import(m)
                except Exception:   # the request then computes its own prompt
                    logger.exception("could not import KV blocks for %s", m.header.request_id)
                out += m.requests
            elif isinstance(m, ExportKV):
                try:
                    m.box.append(self._gather(m.request, m.max_blocks, disk=True))
                except Exception:
                    logger.exception("could not export KV blocks for %s", m.request.request_id)
                    m.box.append(([], None, []))
                m.done.set()
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
        if (h.block_size != kv.block_size or h.shape != want or h.dtype != str(local.dtype).removeprefix("torch.")
                or h.model_hash != self.model_hash() or not h.model_hash):
            logger.warning("KV payload for %s does not fit this replica (%s %s %s vs %s %s %s): computing it here",
                           h.request_id, h.dtype, h.shape, h.model_hash[:8], local.dtype, want, self.model_hash()[:8])
            self.rejected_blocks += len(h.hashes)
            return
        if zlib.crc32(m.data) != h.checksum:
            logger.warning("KV payload for %s fails its checksum: computing it here", h.request_id)
            self.rejected_blocks += len(h.hashes)
            return
        n = len(h.hashes)
        for req in m.requests[:1]:     # land only the blocks this request's own chain names
            mine = prompt_block_hashes(kv, req, min(n, (len(req.prompt_token_ids) - 1) // kv.block_size))
            n = next((j for j, (a, b) in enumerate(zip(h.hashes, mine)) if a != b), len(mine))
            self.rejected_blocks += len(h.hashes) - n
        todo = [j for j, bh in enumerate(h.hashes[:n]) if bh not in kv.cached]
        held = {kv.cached[bh] for bh in h.hashes[:n] if bh in kv.cached}    # the chain's blocks already here
        victims = kv.take_free_blocks(len(todo), held)    # least recently freed: their contents forgotten
        if self.core.offload is not None:
            self.core.offload.save()      # blocks noted for the disk tier leave the tensors before they change
        if not victims:
            return
        todo = todo[:len(victims)]
        data = torch.frombuffer(bytearray(m.data), dtype=torch.uint8).view(local.dtype).view(want)
        self.core.runner.write_blocks(victims, data[:, :, todo].permute(2, 0, 1, 3, 4, 5))
        for b, j in zip(victims, todo):
            kv.register_cached(b, h.hashes[j])             # free and cached, most recently used
        self.imported_blocks += len(victims)
