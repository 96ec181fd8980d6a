"""`open_backends(settings)`: the stores a server uses, picked from --database-url / --redis-url.

    state               embedded (one process)           shared (several processes/machines)
    ------------------  -------------------------------  --------------------------------------------
    keys, usage ledger  SQLite   keys.KeyStore           PostgreSQL  keys.KeyStore
    key-lookup cache    (the SQLite store's memory)      Redis  redis_state.CachedKeyStore (keys in PostgreSQL)
    rate-limit buckets  memory   ratelimit.RateLimiter   Redis  redis_state.RedisRateLimiter (Lua)
    conversations       SQLite   conversations.ConversationStore   PostgreSQL, the same class
    arena battles       SQLite   arena.ArenaStore        PostgreSQL, the same class
    stored responses    SQLite   responses.ResponseStore           PostgreSQL, the same class
    moderation policies SQLite   moderation_policies.PolicyStore   PostgreSQL, the same class
    files, batches      SQLite   files.FileStore, batches.BatchStore  PostgreSQL, the same classes
    semantic cache      SQLite   semantic_cache.SQLiteBackend      Redis  redis_cache.RedisCacheBackend
    live counters       memory   counters.MemoryCounters Redis  redis_state.RedisCounters

--database-url puts every SQL store on one shared PostgreSQL pool (postgres.py); --redis-url puts
the key cache, buckets and counters in Redis (the semantic cache's backend is picked the same way
by routing/step.py, which owns the cache). With neither URL the server keeps everything in its SQLite
file and memory. Redis holds only what can be rebuilt (a cache, buckets that refill, counters);
everything that must survive a crash is in the database. Redis and psycopg are imported only
when their URL is given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.server.gates.ratelimit import RateLimiter
from kvserve.server.stores.arena import ArenaStore
from kvserve.server.stores.batches import BatchStore
from kvserve.server.stores.common import DATABASE_SCHEMES, REDIS_SCHEMES, check_url
from kvserve.server.stores.conversations import ConversationStore
from kvserve.server.stores.counters import CounterBackend, MemoryCounters
from kvserve.server.stores.files import FileStore
from kvserve.server.stores.keys import KeyBackend, KeyStore
from kvserve.server.stores.moderation_policies import PolicyStore
from kvserve.server.stores.responses import ResponseStore

if TYPE_CHECKING:
    from kvserve.server.settings import ServerSettings

logger = logging.getLogger("kvserve.server")


@dataclass
class StateBackends:
    """The stores one server uses; `close()` closes all of them."""

    keys: KeyBackend
    limiter: RateLimiter
    counters: CounterBackend
    conversations: ConversationStore | None = None
    arena: ArenaStore | None = None   # None: the arena opens its SQLite store itself
    responses: ResponseStore | None = None   # stored Responses (the Responses API)
    policies: PolicyStore | None = None      # moderation policies per key / tier
    files: FileStore | None = None           # /v1/files
    batches: BatchStore | None = None        # /v1/batches
    _closers: list[Any] = field(default_factory=list)

    def close(self) -> None:
        _close_all(self._closers)


def _close_all(closers: list[Any]) -> None:
    for closer in closers:
        try:
            closer()
        except Exception:   # closing a store that lost its server must not stop the others
            logger.warning("closing a state store failed", exc_info=True)


def open_key_backend(db_path, database_url: str | None = None, redis_url: str | None = None,
                     redis_client: Any = None, db: Any = None) -> KeyBackend:
    """The key store alone (the `kvserve keys` CLI): SQLite at `db_path`, or PostgreSQL (on the
    pool `db` when given) with, when Redis is given too, the key-lookup cache in front (changes
    made here then invalidate every server's cache at once). SQLite keys are never cached in
    Redis: they are this machine's, already in memory, and servers with different SQLite files
    sharing one Redis must not accept each other's keys."""
    if redis_url:
        check_url(redis_url, "--redis-url", REDIS_SCHEMES)
    if database_url:
        check_url(database_url, "--database-url", DATABASE_SCHEMES)
    store: Any = KeyStore(db if db is not None else database_url or db_path)
    if database_url and (redis_url or redis_client is not None):
        from kvserve.server.stores.redis_state import CachedKeyStore, connect_redis

        client = redis_client or connect_redis(redis_url)
        store = CachedKeyStore(store, client, owns_client=redis_client is None)
    return store


def open_backends(settings: ServerSettings, *, page_stores: bool = True) -> StateBackends:
    """The stores `settings` asks for: the embedded ones unless --database-url / --redis-url
    (`page_stores=False`: without the web page's conversations and arena)."""
    redis_client = None
    closers: list[Any] = []
    try:
        if settings.redis_url:
            from kvserve.server.stores.redis_state import connect_redis

            redis_client = connect_redis(check_url(settings.redis_url, "--redis-url", REDIS_SCHEMES))
            closers.append(redis_client.close)
        db: Any = None
        if settings.database_url:
            from kvserve.server.stores.postgres import PostgresDatabase

            db = PostgresDatabase(check_url(settings.database_url, "--database-url", DATABASE_SCHEMES))
            closers.insert(0, db.close)
        where = db if db is not None else settings.db_path   # each SQLite store opens its own connection
        keys = open_key_backend(settings.db_path, settings.database_url, redis_client=redis_client, db=db)
        closers.insert(0, keys.close)
        if redis_client is not None:
            from kvserve.server.stores.redis_state import RedisCounters, RedisRateLimiter

            limiter: Any = RedisRateLimiter(redis_client)
            counters: Any = RedisCounters(redis_client)
        else:
            limiter, counters = RateLimiter(), MemoryCounters()

        def opened(store: Any) -> Any:
            closers.insert(0, store.close)
            return store

        convs = opened(ConversationStore(where, settings.store_limits())) if page_stores else None
        arena = opened(ArenaStore(db, settings.quota("arena"))) if page_stores and db is not None else None
        responses = opened(ResponseStore(where, settings.quota("responses")))
        policies = opened(PolicyStore(where))
        files = opened(FileStore(where, settings.file_limits()))
        batches = opened(BatchStore(where, settings.quota("batches")))
    except BaseException:
        _close_all(closers)
        raise
    return StateBackends(keys=keys, limiter=limiter, counters=counters, conversations=convs, arena=arena,
                         responses=responses, policies=policies, files=files, batches=batches, _closers=closers)
