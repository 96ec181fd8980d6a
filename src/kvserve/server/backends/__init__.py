"""Shared state: one backend interface per store, so several kvserve processes can share it.

Every piece of state the gateway keeps lives behind one of these interfaces (base.py):

    store              embedded default (one process)       shared (several processes/machines)
    -----------------  -----------------------------------  ------------------------------------
    keys               SQLite   keys.KeyStore                PostgreSQL  pg_keys.PostgresKeyStore
    key-lookup cache   (in the SQLite store's memory)        Redis  redis_state.CachedKeyStore (keys in PostgreSQL)
    usage ledger       SQLite   keys.KeyStore                PostgreSQL  pg_keys.PostgresKeyStore
    rate-limit buckets memory   ratelimit.RateLimiter        Redis  redis_state.RedisRateLimiter (Lua)
    conversations      SQLite   conversations.ConversationStore  PostgreSQL pg_conversations
    arena battles      SQLite   arena.ArenaStore             PostgreSQL  pg_arena.PostgresArenaStore
    stored responses   SQLite   responses_store.ResponseStore   PostgreSQL pg_responses
    moderation policy  SQLite   moderation_policy.PolicyStore   PostgreSQL pg_moderation
    semantic cache     SQLite   semantic_cache.SQLiteBackend    Redis  redis_cache.RedisCacheBackend
    live counters      memory   counters.MemoryCounters      Redis  redis_state.RedisCounters

`open_backends(settings)` (factory.py) picks them from `--database-url` (PostgreSQL: keys, ledger,
conversations, arena, stored responses, moderation policies) and `--redis-url` (Redis: key cache,
buckets, counters); the semantic cache's backend is picked the same way by features.py
(`ServerFeatures.create`), which owns the cache. With neither URL, the server behaves exactly as before. Redis holds only what can be rebuilt (a cache, buckets that refill,
counters); everything that must survive a crash is in the database.

PostgreSQL schemas are migrations under a version table (postgres.py `migrate`): each store
owns a component name and an ordered list of steps. A new store adds
`pg_<store>.py` with its own component and steps, a Protocol in base.py, and one line in
`open_backends`; nothing else changes.
"""

from kvserve.server.backends.base import (
    ArenaBackend,
    ConversationBackend,
    CounterBackend,
    KeyBackend,
    PolicyBackend,
    RateLimitBackend,
    ResponseBackend,
)
from kvserve.server.backends.factory import StateBackends, open_backends, open_key_backend

__all__ = ["ArenaBackend", "ConversationBackend", "CounterBackend", "KeyBackend", "PolicyBackend", "RateLimitBackend",
           "ResponseBackend", "StateBackends", "open_backends", "open_key_backend"]
