"""The semantic cache's entries in Redis (semantic_cache.CacheBackend), so replicas share answers.

Layout, under `kvserve:scache:`:
    vec:<partition>   hash  entry id -> 8-byte float64 `created` + the vector as raw float32 bytes
    meta:<partition>  hash  entry id -> the entry's other fields (JSON)
    lru               zset  "<partition>:<id>" scored by last use (the LRU bound)
    created           zset  "<partition>:<id>" scored by creation (the TTL sweep)

`nearest` fetches the partition's vectors (one HGETALL: a partition is the handful of entries
that share the exact part of a request) and computes the cosines in numpy, then fetches the
winner's fields. `put` is one Lua script, atomic across replicas: it stores the entry, sets the
partition's hashes to expire `ttl_s` after their last write (Redis expiry drops idle
partitions), deletes the entries older than `ttl_s` and then the least recently used past
`max_entries`. A hit (`touch`) is one ZADD. Entries older than the TTL are never returned, even
before they are swept.

The cache is an optimization: a failed write or touch is logged and dropped; a failed lookup
raises (routing/step.py counts it as an `error` and serves the request without the cache).
"""

from __future__ import annotations

import json
import logging
import struct
from typing import Any

import numpy as np

from kvserve.server.routing.semantic_cache import Entry
from kvserve.server.stores.common import REDIS_SCHEMES, check_url
from kvserve.server.stores.redis_state import PREFIX, connect_redis, redis_errors

logger = logging.getLogger("kvserve.server")
NS = PREFIX + "scache:"

# KEYS: vec hash, meta hash, lru zset, created zset.
# ARGV: member, id, vector value, meta JSON, last_used, created, ttl ms, max entries, created cutoff, NS.
PUT = """
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('PEXPIRE', KEYS[2], ARGV[7])
redis.call('ZADD', KEYS[3], ARGV[5], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[6], ARGV[1])
local function drop(m)
  local p, i = string.match(m, '^(.*):([^:]*)$')
  redis.call('HDEL', ARGV[10] .. 'vec:' .. p, i)
  redis.call('HDEL', ARGV[10] .. 'meta:' .. p, i)
  redis.call('ZREM', KEYS[3], m)
  redis.call('ZREM', KEYS[4], m)
end
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', '(' .. ARGV[9])) do drop(m) end
local over = redis.call('ZCARD', KEYS[3]) - tonumber(ARGV[8])
if over > 0 then
  for _, m in ipairs(redis.call('ZRANGE', KEYS[3], 0, over - 1)) do drop(m) end
end
return over
"""
_META = ("query", "answer", "finish_reason", "prompt_tokens", "completion_tokens", "token_ids")


class RedisCacheBackend:
    """Semantic-cache entries in Redis (see the module's docstring)."""
    remote = True   # a network round trip per call: the cache calls it off the event loop

    def __init__(self, url: str, ttl_s: float):
        # Vectors are bytes: this client does not decode replies (the other Redis stores' does).
        self.client: Any = connect_redis(check_url(url, "--redis-url", REDIS_SCHEMES), decode_responses=False)
        self.ttl_s = ttl_s
        self._put = self.client.register_script(PUT)

    @redis_errors
    def nearest(self, partition: str, vector: np.ndarray, now: float, max_age_s: float) -> tuple[Entry, float] | None:
        raw = self.client.hgetall(NS + "vec:" + partition)
        ids, vecs = [], []
        for i, value in raw.items():
            (created,) = struct.unpack_from("<d", value)
            if now - created <= max_age_s:
                ids.append(i.decode())
                vecs.append(np.frombuffer(value, dtype=np.float32, offset=8))
        if not ids:
            return None
        sims = np.stack(vecs) @ vector
        best = int(np.argmax(sims))
        meta = self.client.hget(NS + "meta:" + partition, ids[best])
        if meta is None:   # evicted by another replica in between
            return None
        m = json.loads(meta)
        entry = Entry(ids[best], partition, m["query"], vecs[best], m["answer"], m["finish_reason"],
                      m["prompt_tokens"], m["completion_tokens"], m["created"], m["last_used"],
                      m.get("token_ids"))     # entries stored before the ids were kept: re-tokenized
        return entry, float(sims[best])

    def put(self, entry: Entry, max_entries: int) -> None:
        import redis

        value = struct.pack("<d", entry.created) + np.asarray(entry.vector, dtype=np.float32).tobytes()
        meta = json.dumps({**{k: getattr(entry, k) for k in _META}, "created": entry.created,
                           "last_used": entry.last_used})
        try:
            self._put(keys=[NS + "vec:" + entry.partition, NS + "meta:" + entry.partition, NS + "lru", NS + "created"],
                      args=[f"{entry.partition}:{entry.id}", entry.id, value, meta, entry.last_used, entry.created,
                            int(self.ttl_s * 1000) + 1000, max_entries, entry.created - self.ttl_s, NS])
        except redis.RedisError:
            logger.warning("storing a semantic-cache entry in Redis failed", exc_info=True)

    def touch(self, entry: Entry, now: float) -> None:
        import redis

        entry.last_used = now
        try:
            self.client.zadd(NS + "lru", {f"{entry.partition}:{entry.id}": now}, xx=True)
        except redis.RedisError:
            logger.warning("recording a semantic-cache hit in Redis failed", exc_info=True)

    def close(self) -> None:
        self.client.close()
