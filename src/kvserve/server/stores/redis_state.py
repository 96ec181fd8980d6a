"""The Redis backends: rate-limit buckets, the key-lookup cache and live counters, shared by replicas.

* `RedisRateLimiter`: each bucket is a Redis hash {tokens, ts, cap} updated by one Lua script
  (`TOKEN_BUCKET`), so refill, check and take are one atomic step however many replicas call it
  at once, and the clock is Redis's (`TIME`), so the replicas' own clocks do not matter. It is
  the in-memory `RateLimiter` with its three bucket primitives overridden: the messages,
  Retry-After and `x-ratelimit-*` headers are the same code.
* `CachedKeyStore`: a key-lookup cache in front of the key store (SQLite or PostgreSQL). A
  presented key is hashed (SHA-256) and the hash looked up in Redis; a miss asks the store and
  caches the answer (a miss too, for a shorter time). Every create/revoke through a store that
  has the cache bumps a generation number that is part of each cache entry's name, so a change
  made by any process configured with the same Redis (servers, `kvserve keys --redis-url`) is
  seen by all at once; a change made without it is seen within `ttl_s`.
  Looking a hash up by name leaks nothing useful: the hash is of a 256-bit random key.
* `RedisCounters`: named cumulative counters (INCRBY on one hash).

Redis keeps nothing that must survive it: a flushed cache refills, buckets start full, counters
restart. Every Redis failure on the request path is a 503 with Retry-After
(`StateStoreUnavailable`), never a 500 and never a silently unlimited key.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

from kvserve.server.gates.ratelimit import RateLimiter
from kvserve.server.stores.common import StateStoreUnavailable, redact
from kvserve.server.stores.keys import ApiKey, hash_key

PREFIX = "kvserve:"

# KEYS[1]: the bucket. ARGV: capacity, refill per second, amount, mode ("take" | "give" | "peek").
# Returns {wait, tokens} as strings (Lua numbers returned to Redis would be cut to integers):
# wait is 0 when taken (or for give/peek), the seconds until `amount` is there, or -1 for never.
TOKEN_BUCKET = """
local cap = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local amount = tonumber(ARGV[3])
local mode = ARGV[4]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts', 'cap')
local tokens = tonumber(b[1])
local ts = tonumber(b[2])
if tokens == nil or ts == nil or tonumber(b[3]) ~= cap then
  tokens = cap
  ts = now
end
tokens = math.min(cap, tokens + math.max(0, now - ts) * rate)
local wait = 0
if mode == 'take' then
  if amount > cap then
    wait = -1
  elseif tokens >= amount then
    tokens = tokens - amount
  else
    wait = (amount - tokens) / rate
  end
elseif mode == 'give' then
  tokens = math.min(cap, tokens + amount)
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens), 'ts', string.format('%.6f', now),
           'cap', ARGV[1])
redis.call('PEXPIRE', KEYS[1], math.ceil((cap - tokens) / rate * 1000) + 60000)
return {string.format('%.6f', wait), string.format('%.6f', tokens)}
"""

# KEYS[1]: the generation counter; ARGV[1]: the entry prefix; ARGV[2]: the key hash.
CACHE_GET = """
local gen = redis.call('GET', KEYS[1]) or '0'
return {gen, redis.call('GET', ARGV[1] .. gen .. ':' .. ARGV[2])}
"""


def _unavailable(e: Exception) -> StateStoreUnavailable:
    return StateStoreUnavailable(f"The shared state store (Redis) is unavailable ({type(e).__name__}); "
                                 "retry shortly.", retry_after=2.0)


def redis_errors(fn):
    """Turn a lost Redis connection into a 503 with Retry-After."""
    import redis

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise _unavailable(e) from None
    return wrapper


def connect_redis(url: str, *, decode_responses: bool = True) -> Any:
    """A client for `url`, checked with PING (a clear error when Redis is not there)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5, decode_responses=decode_responses,
                                  health_check_interval=30)
    try:
        client.ping()
    except redis.RedisError as e:
        client.close()
        raise StateStoreUnavailable(f"Cannot reach Redis at {redact(url)} ({e}). Start it, or leave out "
                                    "--redis-url to keep rate limits in this process.") from None
    return client


class RedisRateLimiter(RateLimiter):
    """RateLimiter whose buckets live in Redis (see the module's docstring)."""
    remote = True   # a network round trip per call (the gateway runs it off the event loop)

    def __init__(self, client: Any) -> None:
        super().__init__()
        self._script = client.register_script(TOKEN_BUCKET)

    @redis_errors
    def _call(self, key_name: str, kind: str, per_minute: int, amount: float, mode: str) -> tuple[float, float]:
        key = f"{PREFIX}bucket:{kind}:{key_name}"
        wait, tokens = self._script(keys=[key], args=[per_minute, per_minute / 60.0, amount, mode])
        wait = float(wait)
        return (math.inf if wait < 0 else wait), float(tokens)

    def _take(self, key_name: str, kind: str, per_minute: int, amount: float) -> float:
        return self._call(key_name, kind, per_minute, amount, "take")[0]

    def _give(self, key_name: str, kind: str, per_minute: int, amount: float) -> None:
        self._call(key_name, kind, per_minute, amount, "give")

    def _peek(self, key_name: str, kind: str, per_minute: int) -> float:
        return self._call(key_name, kind, per_minute, 0, "peek")[1]


class CachedKeyStore:
    """A key store with its lookups cached in Redis (see the module's docstring)."""
    remote = True   # a network round trip per call (the gateway runs it off the event loop)

    def __init__(self, store: Any, client: Any, *, ttl_s: float = 30.0, miss_ttl_s: float = 5.0,
                 owns_client: bool = False) -> None:
        self.store = store
        self.client = client
        self.ttl_ms = int(ttl_s * 1000)
        self.miss_ttl_ms = int(miss_ttl_s * 1000)
        self._owns_client = owns_client
        self._get = client.register_script(CACHE_GET)
        self._gen_key = PREFIX + "keycache:gen"
        self._entry = PREFIX + "keycache:"
        self._any_key = PREFIX + "keycache:any"
        self._auth_on = False

    def close(self) -> None:
        self.store.close()
        if self._owns_client:
            self.client.close()

    @redis_errors
    def _changed(self) -> None:
        self.client.incr(self._gen_key)

    # --- administration: the store's, then the cache is invalidated ---

    def create(self, name: str, *, tier: str = "paid", rpm: int | None = None, tpm: int | None = None) -> str:
        key = self.store.create(name, tier=tier, rpm=rpm, tpm=tpm)
        self._changed()
        return key

    def revoke(self, name: str) -> bool:
        done = self.store.revoke(name)
        self._changed()
        return done

    def list(self) -> list[ApiKey]:
        return self.store.list()

    # --- the request path ---

    @redis_errors
    def auth_required(self) -> bool:
        # Keys are never deleted (revoked ones still count): once auth is on it stays on, so
        # that answer is kept here and in Redis for good.
        if self._auth_on or self.client.get(self._any_key):
            self._auth_on = True
            return True
        required = self.store.auth_required()
        if required:
            self.client.set(self._any_key, "1")
            self._auth_on = True
        return required

    @redis_errors
    def lookup(self, presented: str) -> ApiKey | None:
        digest = hash_key(presented)
        gen, cached = self._get(keys=[self._gen_key], args=[self._entry, digest])
        if cached is not None:
            data = json.loads(cached)
            return ApiKey(**data) if data else None
        key = self.store.lookup(presented)
        value = json.dumps(key.__dict__ if key is not None else None)
        self.client.set(f"{self._entry}{gen}:{digest}", value,
                        px=self.ttl_ms if key is not None else self.miss_ttl_ms)
        return key

    # --- usage ledger: the store's ---

    def record_usage(self, key_name: str | None, prompt_tokens: int, completion_tokens: int,
                     cached_tokens: int, *, requests: int = 1) -> None:
        self.store.record_usage(key_name, prompt_tokens, completion_tokens, cached_tokens, requests=requests)

    def usage(self, key_name: str | None = None) -> list[dict]:
        return self.store.usage(key_name)


class RedisCounters:
    """Named cumulative counters in one Redis hash, summed over every replica."""
    remote = True   # a network round trip per call (the gateway runs it off the event loop)

    def __init__(self, client: Any) -> None:
        self.client = client
        self._key = PREFIX + "counters"

    @redis_errors
    def incr(self, name: str, amount: int = 1) -> None:
        self.client.hincrby(self._key, name, amount)

    @redis_errors
    def snapshot(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.client.hgetall(self._key).items()}

    def close(self) -> None:
        pass
