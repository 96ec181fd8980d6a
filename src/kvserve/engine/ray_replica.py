"""EngineReplica: one EngineCore inside a Ray actor (the peer of engine/ray_client.py's RayClient).

The actor loads the model, runs the core's busy loop in a thread of its own and exposes three
methods that carry only bytes (msgspec/msgpack messages of kvserve.engine.messages, tensors as raw
bytes with a msgpack header): nothing of ours is pickled on its way across Ray.

    ready()            -> EngineReady (what the gateway needs: window, block size, the tokenizer)
    submit([msg...])   client messages in (EngineCoreRequest, AbortRequests), in order
    outputs(timeout)   long poll: every EngineCoreOutputs produced since the last call

`submit` runs in the actor's default concurrency group (one thread: calls run in the order they
were sent), `outputs` in its own group, so a waiting poll never holds a submit back.

A replica may also take a role in disaggregated serving (engine/disagg.py): a prefill replica
exports the KV blocks of a finished prompt, a decode replica imports them into its prefix cache
before the request that uses them is admitted. Every replica exports a prefix it holds on demand
(`export_prefix`) and imports one with a request (`submit_with_kv`): the gateway moves prefixes
between replicas that share no disk store. Its first stats carry its tiers (`replica_tier`): the
router counts a disk store's blocks for every replica on the same node and directory.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading

import msgspec

from kvserve.engine.messages import CoreInput, EngineReady, Shutdown, decode_input, encode, poll_queue

logger = logging.getLogger("kvserve.engine")

TIER_SUMMARY_BLOCKS = 4096      # hashes of a disk store a replica reports when it starts (16 bytes each)


def replica_tier(core, node: str, summary_blocks: int = TIER_SUMMARY_BLOCKS) -> dict:
    """What the router needs of a replica's tiers (PrefixAffinityRouter.set_tier): its KV pool's
    blocks and, with a disk tier, a key naming the store (this node and the store's real path:
    replicas with the same key share the blocks), its capacity in blocks and the hashes it holds."""
    out = {"ram_blocks": getattr(core.kv, "num_blocks", 0), "disk": None, "disk_blocks": 0, "held": []}
    off = getattr(core, "offload", None)
    if off is not None:
        store = off.store
        per_block = math.prod(off.shape) * core.runner.kv_caches[0].element_size()
        out.update(disk=f"{node}:{os.path.realpath(store.dir)}", disk_blocks=max(1, store.max_bytes // per_block),
                   held=store.recent_hashes(summary_blocks)[::-1])
    return out


class EngineReplica:
    def __init__(self, spec: bytes):
        from kvserve.engine.config import EngineConfig
        from kvserve.engine.core import EngineCore
        from kvserve.engine.executor import load_engine_model
        from kvserve.engine.process import tokenizer_spec

        s = msgspec.json.decode(spec)
        self.index = s.get("index", 0)
        cfg = EngineConfig(weight_format=s["weight_format"], **s["engine_kwargs"])
        loaded = load_engine_model(s["model"], s["weight_format"], cfg)
        self.core = EngineCore(loaded.model, cfg, loaded.tokenizer.eos_token_ids, loaded.tokenizer)
        self._ready = encode(EngineReady(
            model_name=loaded.source.name, max_model_len=self.core.max_model_len, block_size=self.core.block_size,
            vocab_size=loaded.model.config.vocab_size, kv_cache_limited=self.core.context_limited_by_kv,
            enable_prefix_caching=cfg.enable_prefix_caching, tokenizer=tokenizer_spec(loaded.tokenizer)))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        from kvserve.engine.disagg import KVTransfer

        self.kv_transfer = KVTransfer(self.core, s.get("role") or "serve")
        self.node = s.get("node") or _node_id()
        self._thread = threading.Thread(target=self._run, name="kvserve-replica", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.core.run_busy_loop(self._poll, self.kv_transfer.wrap_emit(self._outbox.put))

    def _poll(self, timeout: float) -> list[CoreInput]:
        return self.kv_transfer.on_inputs(poll_queue(self._inbox, timeout))

    # ---- the actor's methods ----------------------------------------------------------------
    def ready(self) -> bytes:
        return self._ready

    def stats(self) -> bytes:
        """The core's stats as msgpack (the gateway's first snapshot; later ones ride on outputs),
        with its tiers under "replica_tier"."""
        return msgspec.msgpack.encode({**self.core.stats(), "replica_tier": replica_tier(self.core, self.node)})

    def pid(self) -> int:
        return os.getpid()

    def submit(self, msgs: list[bytes]) -> None:
        for data in msgs:
            try:
                self._inbox.put(decode_input(data))
            except msgspec.DecodeError as e:    # not a message of ours: drop it, keep serving
                logger.error("replica %d dropped an undecodable message: %s", self.index, e)

    def submit_with_kv(self, kv: bytes, msgs: list[bytes]) -> None:
        """Disaggregated decode, or a fetched prefix: the prompt's KV blocks (engine/disagg.py's
        payload) and the requests that continue from them, one item of the core's inbox (the
        blocks land first; only those the first request's own chain names)."""
        item = self.kv_transfer.decode_payload(kv)
        for data in msgs:
            try:
                item.requests.append(decode_input(data))
            except msgspec.DecodeError as e:
                logger.error("replica %d dropped an undecodable message: %s", self.index, e)
        self._inbox.put(item)

    def export_prefix(self, msg: bytes, max_blocks: int) -> tuple[bytes, bytes]:
        """(a small status, the KV payload of the longest prefix of this request's first max_blocks
        blocks held here, RAM then disk); called with num_returns=2 like `prefill`, so the payload
        goes from this replica to the one that asked through the object store. Runs in the actor's
        "export" group: a wait for the core never holds a submit back."""
        return b"ok", self.kv_transfer.export_prefix(decode_input(msg), max_blocks, self._inbox.put)

    def prefill(self, msg: bytes) -> tuple[bytes, bytes]:
        """Disaggregated prefill: run this request (max_tokens 1) and return (a small status, its
        prompt's KV payload) once it finished; called with num_returns=2, so the gateway waits on
        the status and hands the payload's reference on without fetching it. Runs in the actor's
        "prefill" group: several may wait."""
        return b"ok", self.kv_transfer.prefill(decode_input(msg), self._inbox.put)

    def outputs(self, timeout: float = 0.2) -> list[bytes]:
        try:
            items = [self._outbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        try:
            while True:
                items.append(self._outbox.get_nowait())
        except queue.Empty:
            pass
        return [encode(o) if isinstance(o, msgspec.Struct) else o for o in items]

    def shutdown(self) -> None:
        self._inbox.put(Shutdown())
        self._thread.join(10)


def _node_id() -> str:
    """The Ray node this actor runs on (the host name outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:   # noqa: BLE001 - not in a Ray worker
        import socket

        return socket.gethostname()
