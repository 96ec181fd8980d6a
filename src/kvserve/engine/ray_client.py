"""RayClient: N engine replicas as Ray actors behind one EngineClient, so the server sees one engine.

    kvserve serve --replicas 2                      a local Ray cluster, 2 replicas
    kvserve serve --replicas 4 --ray-address HOST:6379    join an existing cluster
    kvserve serve --prefill-replicas 1 --decode-replicas 2  disaggregated (engine/disagg.py)

Each replica is an EngineReplica actor (engine/ray_replica.py) with its own EngineCore, one torch
thread by default. The client does the text work on the event loop as every EngineClient does;
what crosses Ray is msgpack bytes only. Per request:

* routing: PrefixAffinityRouter (engine/replica_router.py) picks the replica holding the longest prefix of
  the prompt in RAM or in its disk tier (replicas on one node sharing `kv_offload_dir` hold each
  other's disk blocks; each reports its tiers in its first stats), balanced against load (requests
  in flight, waiting, KV usage the replica reports); the children of an n > 1 request go together
  (they share the prompt's blocks). When another replica, sharing no disk store with the chosen
  one, holds a longer prefix, the chosen one receives those blocks from it with the request
  (engine/ray_kv_handover.py);
* outputs: one reader thread per replica long-polls `outputs()` and hands each EngineCoreOutputs
  to the loop, as MPClient's reader does;
* a replica that dies (its poll raises) leaves the rotation; its requests that had streamed
  nothing are sent again to another replica (same request, same seed: the same answer), the
  others end with EngineDeadError (503, retryable). The gateway keeps answering while one lives;
* healing and scaling (engine/replica_supervisor.py): a dead replica is started again in its slot,
  and with `replicas="MIN:MAX"` slots are added under load and drained when idle. A slot's
  incarnation is its Replica object: a reader thread only speaks for the object it polls.

Disaggregated: prefill replicas compute each prompt (max_tokens 1) and export its KV blocks
through Ray's object store straight to the chosen decode replica, which imports them into its
prefix cache before the request arrives there; if the prefill fails, the decode replica computes
the prompt itself. `stats()["pools"]` reports each pool's time to first token and the decode
pool's inter-token latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass

import msgspec

from kvserve.engine.client_base import EngineClient, EngineDeadError
from kvserve.engine.messages import (
    AbortRequests,
    CoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    decode_output,
    encode,
)
from kvserve.engine.processing import EngineInfo
from kvserve.engine.ray_cluster import HEAD_THREAD_DONE, reclaim_signals, start_local_cluster
from kvserve.engine.ray_kv_handover import KVHandover
from kvserve.engine.replica_router import PrefixAffinityRouter
from kvserve.engine.replica_supervisor import Replica, ReplicaSupervisor
from kvserve.errors import ModelLoadError

logger = logging.getLogger("kvserve.engine")

_local_cluster = False     # this process started the Ray cluster it is connected to

RESTARTING = "no engine replica is serving right now (one is restarting): send the request again"
_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "kv_blocks_total", "kv_blocks_free")


@dataclass
class PoolTimes:
    requests: int = 0
    ttft_seconds_sum: float = 0.0
    itl_seconds_sum: float = 0.0
    itl_count: int = 0


class RayClient(KVHandover, EngineClient):
    kind = "ray"

    def __init__(self, ready: EngineReady, actors: list, roles: list[str], pids: list[int], owns_cluster: bool):
        from kvserve.engine.process import tokenizer_from_spec

        info = EngineInfo(ready.model_name, ready.max_model_len, ready.block_size, ready.vocab_size,
                          ready.kv_cache_limited)
        super().__init__(tokenizer_from_spec(ready.tokenizer), info, ready.enable_prefix_caching)
        self.replicas = [Replica(i, a, r, p) for i, (a, r, p) in enumerate(zip(actors, roles, pids))]
        self.router = PrefixAffinityRouter(len(actors), ready.block_size)
        self.disaggregated = "prefill" in roles
        self._prefix_caching = ready.enable_prefix_caching
        self._owns_cluster = owns_cluster
        self._where: dict[str, int] = {}                 # core request id -> replica index
        self._reqs: dict[str, EngineCoreRequest] = {}    # core request id -> the request (to resend)
        self._streamed: set[str] = set()                 # client request ids that received tokens
        self._decode_start: dict[str, float] = {}        # disaggregated: core id -> KV handed over
        self._last_token: dict[str, float] = {}
        self.pools = {"prefill": PoolTimes(), "decode": PoolTimes()}
        self.num_retried = 0
        self._closing = False
        self._sent_at: dict[str, float] = {}              # core request id -> dispatched, until its first token
        self.recent_ttft: deque[tuple[float, float]] = deque(maxlen=512)   # (when, seconds to first token)
        self.spawn = None          # (index, role) -> actor, set by launch; the supervisor starts replicas with it
        self.supervisor = None     # ReplicaSupervisor, set by launch

    # ---- launch ---------------------------------------------------------------------------
    @classmethod
    def launch(cls, model: str | None, weight_format: str, engine_kwargs: dict, *, replicas: int = 1,
               max_replicas: int | None = None, target_ttft_ms: float | None = None,
               replica_idle_seconds: float = 60.0, prefill_replicas: int = 0, decode_replicas: int = 0,
               ray_address: str | None = None, timeout: float = 900) -> RayClient:
        """Start the replicas (a local Ray cluster unless one is running or ray_address is given)
        and wait until each has loaded the model (blocking). `replicas` start; with `max_replicas`
        above it the supervisor scales between the two."""
        import ray

        from kvserve.engine.ray_replica import EngineReplica

        roles = (["prefill"] * prefill_replicas + ["decode"] * decode_replicas if prefill_replicas or decode_replicas
                 else ["serve"] * replicas)
        global _local_cluster
        owns = False
        if not ray.is_initialized():
            if ray_address:
                ray.init(address=ray_address, include_dashboard=False)
            else:
                start_local_cluster(max(2, len(roles), max_replicas or 0))
                owns = _local_cluster = True
        kwargs = {"num_threads": 1, **engine_kwargs}
        # On a shared cluster each replica claims a CPU, so Ray places replicas where cores are free.
        # On the local cluster this process started, the cores are known and each replica's thread
        # count is set: claiming none lets a second model's replicas start beside the first's.
        cpus = 0 if _local_cluster and not ray_address else 1
        groups = {"poll": 1, "prefill": 32, "kv": 1, "export": 4}
        actor_cls = ray.remote(num_cpus=cpus, max_restarts=0, concurrency_groups=groups)(EngineReplica)

        def spawn(index: int, role: str):
            return actor_cls.remote(msgspec.json.encode({"model": model, "weight_format": weight_format,
                                                         "engine_kwargs": kwargs, "index": index,
                                                         "role": None if role == "serve" else role}))

        actors = [spawn(i, role) for i, role in enumerate(roles)]
        try:
            readies = [decode_output(r) for r in ray.get([a.ready.remote() for a in actors], timeout=timeout)]
            pids = ray.get([a.pid.remote() for a in actors], timeout=60)
            first_stats = [msgspec.msgpack.decode(b) for b in ray.get([a.stats.remote() for a in actors], timeout=60)]
        except Exception as e:   # noqa: BLE001 - RayActorError, GetTimeoutError: reported as a load error
            for a in actors:
                with contextlib.suppress(Exception):
                    ray.kill(a)
            if owns:
                ray.shutdown()
                HEAD_THREAD_DONE.set()
            last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"an engine replica could not start: {last}") from None
        client = cls(readies[0], actors, roles, pids, owns)
        for rep, stats in zip(client.replicas, first_stats):
            client.note_tier(rep.index, stats)
            rep.stats = stats
        client.spawn = spawn
        client.supervisor = ReplicaSupervisor(client, min_replicas=len(roles),
                                              max_replicas=max(max_replicas or 0, len(roles)),
                                              target_ttft_ms=target_ttft_ms, idle_down=replica_idle_seconds)
        return client

    def note_tier(self, index: int, stats: dict) -> None:
        """A (re)started replica's first stats carry its tiers (engine/ray_replica.py's
        replica_tier): the router counts its disk store for it."""
        tier = stats.pop("replica_tier", None)
        if tier:
            self.router.set_tier(index, tier.get("ram_blocks", 0), tier.get("disk"), tier.get("disk_blocks", 0),
                                 tier.get("held") or [])

    async def start(self) -> None:
        await super().start()
        reclaim_signals()
        for rep in self.replicas:
            self.start_reader(rep)
        if self.supervisor is not None:
            self.supervisor.start()

    def start_reader(self, rep: Replica) -> None:
        if rep.reader is None:
            rep.reader = threading.Thread(target=self._read, args=(rep,), daemon=True,
                                          name=f"kvserve-replica-{rep.index}")
            rep.reader.start()

    async def shutdown(self) -> None:
        import ray

        if self._closing:
            return
        self._closing = True
        if self.supervisor is not None:
            await self.supervisor.stop()
        if not ray.is_initialized():   # the cluster went down with another model's client: nothing to stop
            return
        live = [r for r in self.replicas if r.alive]
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ray.get, [r.actor.shutdown.remote() for r in live], timeout=15)
        for r in self.replicas:
            with contextlib.suppress(Exception):
                ray.kill(r.actor)
        for r in self.replicas:
            if r.reader is not None:
                await asyncio.to_thread(r.reader.join, 5)
        if self._owns_cluster:
            global _local_cluster
            _local_cluster = False
            await asyncio.to_thread(ray.shutdown)
            HEAD_THREAD_DONE.set()

    # ---- the replicas' outputs --------------------------------------------------------------
    def _read(self, rep: Replica) -> None:
        import ray

        while not self._closing and rep.alive:
            try:
                batch = ray.get(rep.actor.outputs.options(concurrency_group="poll").remote(0.2), timeout=120)
            except Exception as e:   # noqa: BLE001 - the actor died (or hangs): out of rotation
                if not self._closing:
                    self._call_soon(self._replica_died, rep, f"{type(e).__name__}")
                return
            for data in batch:
                msg = decode_output(data)
                if isinstance(msg, EngineCoreOutputs):
                    self._call_soon(self._on_replica_outputs, rep, msg)

    def _on_replica_outputs(self, rep: Replica, outs: EngineCoreOutputs) -> None:
        """On the event loop."""
        index = rep.index
        if not rep.alive or self.replicas[index] is not rep:
            return                  # late words of a dead replica (or an earlier incarnation): moved on
        if outs.stats is not None:
            rep.stats = outs.stats
            self.router.report(index, outs.stats.get("num_requests_waiting", 0),
                               outs.stats.get("kv_cache_usage_perc", 0.0))
        now = time.monotonic()
        ended = []
        for o in outs.outputs:
            if o.request_id not in self._where:
                continue            # a prefill request, or one already moved or finished
            if o.new_token_ids:
                sent = self._sent_at.pop(o.request_id, None)
                if sent is not None:
                    self.recent_ttft.append((now, now - sent))
                parent = self.outputs.parent_of.get(o.request_id)
                if parent is not None:
                    self._streamed.add(parent)
                self._pool_times(o.request_id, len(o.new_token_ids), now)
            if o.finish_reason is not None and self._where[o.request_id] == index:
                ended.append(self.outputs.parent_of.get(o.request_id))
                del self._where[o.request_id]
                self._reqs.pop(o.request_id, None)
                self._sent_at.pop(o.request_id, None)
                self._decode_start.pop(o.request_id, None)
                self._last_token.pop(o.request_id, None)
                self.router.done(index)
        self._on_outputs(outs)
        for parent in ended:
            if parent not in self.outputs.requests:
                self._streamed.discard(parent)

    def _pool_times(self, core_id: str, n: int, now: float) -> None:
        if not self.disaggregated:
            return
        start = self._decode_start.pop(core_id, None)
        pool = self.pools["decode"]
        if start is not None:
            pool.requests += 1
            pool.ttft_seconds_sum += now - start
        elif core_id in self._last_token:
            pool.itl_seconds_sum += now - self._last_token[core_id]
            pool.itl_count += n
        self._last_token[core_id] = now

    def _replica_died(self, rep: Replica, message: str) -> None:
        """On the event loop: take the replica out, move or fail its requests, have it healed."""
        index = rep.index
        if not rep.alive or self._closing or self.replicas[index] is not rep:
            return
        rep.alive = False
        rep.state = "dead"
        self.router.mark_dead(index)
        logger.error("engine replica %d (pid %d) is gone (%s); %d left", index, rep.pid, message,
                     len(self._serving()))
        by_parent: dict[str, list[EngineCoreRequest]] = defaultdict(list)
        for cid in [c for c, w in self._where.items() if w == index]:
            del self._where[cid]
            req = self._reqs.pop(cid)
            self._sent_at.pop(cid, None)
            parent = self.outputs.parent_of.get(cid)
            if parent is not None:
                by_parent[parent].append(req)
        healing = self.supervisor is not None and self.supervisor.replica_died(index)
        if not self._serving() and not healing:
            self._fail_all(f"every engine replica is gone (the last: {message})")
            return
        for parent, reqs in by_parent.items():
            if parent in self._streamed:
                self._fail_request(parent, f"the engine replica serving this request died after it had started "
                                           f"streaming ({message}): send it again")
            elif not self._serving():
                self._fail_request(parent, RESTARTING)
            else:
                self.num_retried += 1
                self._dispatch(reqs)

    def _fail_request(self, parent: str, message: str) -> None:
        self._streamed.discard(parent)
        self.outputs.abort(parent)
        q = self._queues.get(parent)
        if q is not None:
            q.put_nowait(EngineDeadError(message))

    def _serving(self) -> list[int]:
        return [r.index for r in self.replicas if r.alive and r.role != "prefill"]

    def health(self) -> None:
        healing = self.supervisor is not None and self.supervisor.healing()
        if self._dead is None and not self._serving() and not self._closing and not healing:
            self._dead = "every engine replica is gone"
        super().health()

    # ---- requests in ------------------------------------------------------------------------
    def _send(self, msgs: list[CoreInput]) -> None:
        groups: dict[str, list[EngineCoreRequest]] = defaultdict(list)
        aborts: dict[int, list[str]] = defaultdict(list)
        for m in msgs:
            if isinstance(m, EngineCoreRequest):
                groups[self.outputs.parent_of.get(m.request_id, m.request_id)].append(m)
            elif isinstance(m, AbortRequests):
                for cid in m.request_ids:
                    if cid in self._where:
                        aborts[self._where[cid]].append(cid)
        for group in groups.values():
            self._dispatch(group)
        for index, ids in aborts.items():
            with contextlib.suppress(Exception):
                self.replicas[index].actor.submit.remote([encode(AbortRequests(ids))])

    def _dispatch(self, group: list[EngineCoreRequest]) -> None:
        """Send a request's core requests (its n children together) to one serving replica."""
        first = group[0]
        others = frozenset(r.index for r in self.replicas if r.role == "prefill")
        try:
            route = self.router.decide(first.prompt_token_ids, first.cache_salt, first.cache_salt_from, exclude=others,
                                       fetch=not self.disaggregated and self._prefix_caching
                                       and first.lora_name is None, to_disk=first.lora_name is None)
        except LookupError:
            if self.supervisor is not None and self.supervisor.healing():
                self._fail_request(self.outputs.parent_of.get(first.request_id, first.request_id), RESTARTING)
            else:
                self._fail_all("every engine replica is gone")
            return
        index = route.index
        self.router.replicas[index].in_flight += len(group) - 1     # counted per core request
        now = time.monotonic()
        for r in group:
            self._where[r.request_id] = index
            self._reqs[r.request_id] = r
            self._sent_at.setdefault(r.request_id, now)    # a resent request keeps its first send
        data = [encode(r) for r in group]
        if self.disaggregated and self._prefill(first, index, data, [r.request_id for r in group]):
            return
        if route.donor is not None:
            self._fetch(first, index, route.donor, data, [r.request_id for r in group])
            return
        self.replicas[index].actor.submit.remote(data)

    # ---- introspection ----------------------------------------------------------------------
    def stats(self) -> dict:
        """The replicas' stats summed (gauges over the live ones only), plus per replica and pool."""
        out: dict = {}
        phases: dict[str, float] = defaultdict(float)
        live = [r for r in self.replicas if r.alive and r.stats]
        for r in self.replicas:
            for k, v in r.stats.items():
                if k in _GAUGES and not r.alive:
                    continue
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[k] = out.get(k, 0) + v
            for k, v in (r.stats.get("phase_seconds") or {}).items():
                phases[k] += v
        out["kv_cache_usage_perc"] = sum(r.stats.get("kv_cache_usage_perc", 0.0) for r in live) / max(1, len(live))
        out["block_size"] = self.block_size
        out["phase_seconds"] = dict(phases)
        out["moe_expert_tokens"] = next((r.stats.get("moe_expert_tokens") for r in live), [])
        # what every replica shares (the same model and engine settings): the first live one's
        for k in ("kv_cache_dtype", "kv_cache_bytes_per_token"):
            if any(k in r.stats for r in live):
                out[k] = next(r.stats[k] for r in live if k in r.stats)
        out["replicas"] = [{"index": r.index, "role": r.role, "alive": r.alive, "state": r.state, "pid": r.pid,
                            "in_flight": self.router.replicas[r.index].in_flight,
                            **{k: r.stats.get(k, 0) for k in ("num_requests_running", "num_requests_waiting",
                                                              "prefix_cache_queries", "prefix_cache_hits",
                                                              "prompt_tokens", "generation_tokens")}}
                           for r in self.replicas]
        out["replicas_alive"] = sum(r.alive for r in self.replicas)
        out["replica_states"] = self.replica_states()
        if self.supervisor is not None:
            out.update(self.supervisor.stats())
        out["requests_retried"] = self.num_retried
        out["kv_prefix_fetches"] = self.num_kv_fetches
        if self.disaggregated:
            out["pools"] = {k: vars(v).copy() for k, v in self.pools.items()}
        return out

    def replica_states(self) -> dict[str, int]:
        """How many slots are starting, serving, draining, stopped or dead (/health, /metrics)."""
        counts = dict.fromkeys(("starting", "serving", "draining", "stopped", "dead"), 0)
        for r in self.replicas:
            counts[r.state] += 1
        return counts
