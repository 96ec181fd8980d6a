"""`open_backends(settings)`: the stores a server uses, picked from --database-url / --redis-url.

Redis and psycopg are imported only when their URL is given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.server.backends.base import (
    ArenaBackend,
    ConversationBackend,
    CounterBackend,
    KeyBackend,
    PolicyBackend,
    RateLimitBackend,
    ResponseBackend,
)
from kvserve.server.backends.common import DATABASE_SCHEMES, REDIS_SCHEMES, check_url

if TYPE_CHECKING:
    from kvserve.server.settings import ServerSettings

logger = logging.getLogger("kvserve.server")


@dataclass
class StateBackends:
    """The stores one server uses; `close()` closes all of them."""

    keys: KeyBackend
    limiter: RateLimitBackend
    counters: CounterBackend
    conversations: ConversationBackend | None = None
    arena: ArenaBackend | None = None   # None: the arena opens its SQLite store itself
    responses: ResponseBackend | None = None   # stored Responses (the Responses API)
    policies: PolicyBackend | None = None      # moderation policies per key / tier
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
        from kvserve.server.backends.pg_keys import PostgresKeyStore

        store: Any = PostgresKeyStore(check_url(database_url, "--database-url", DATABASE_SCHEMES), db=db)
    else:
        from kvserve.server.keys import KeyStore

        store = KeyStore(db_path)
    if database_url and (redis_url or redis_client is not None):
        from kvserve.server.backends.redis_state import CachedKeyStore, connect_redis

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
            from kvserve.server.backends.redis_state import connect_redis

            redis_client = connect_redis(check_url(settings.redis_url, "--redis-url", REDIS_SCHEMES))
            closers.append(redis_client.close)
        db = None
        if settings.database_url:
            from kvserve.server.backends.postgres import Database

            db = Database(check_url(settings.database_url, "--database-url", DATABASE_SCHEMES))
            closers.insert(0, db.close)
        keys = open_key_backend(settings.db_path, settings.database_url, redis_client=redis_client, db=db)
        closers.insert(0, keys.close)
        if redis_client is not None:
            from kvserve.server.backends.redis_state import RedisCounters, RedisRateLimiter

            limiter: Any = RedisRateLimiter(redis_client)
            counters: Any = RedisCounters(redis_client)
        else:
            from kvserve.server.backends.counters import MemoryCounters
            from kvserve.server.ratelimit import RateLimiter

            limiter, counters = RateLimiter(), MemoryCounters()
        convs: Any = None
        if page_stores:
            if settings.database_url:
                from kvserve.server.backends.pg_conversations import PostgresConversationStore

                convs = PostgresConversationStore(settings.database_url, settings.store_limits(), db=db)
            else:
                from kvserve.server.conversations import ConversationStore

                convs = ConversationStore(settings.db_path, settings.store_limits())
            closers.insert(0, convs.close)
        arena: Any = None
        if page_stores and db is not None:
            from kvserve.server.backends.pg_arena import PostgresArenaStore

            arena = PostgresArenaStore(settings.database_url, db=db)
            closers.insert(0, arena.close)
        responses: Any
        policies: Any
        if db is not None:
            from kvserve.server.backends.pg_moderation import PostgresPolicyStore
            from kvserve.server.backends.pg_responses import PostgresResponseStore

            responses = PostgresResponseStore(settings.database_url, db=db)
            closers.insert(0, responses.close)
            policies = PostgresPolicyStore(settings.database_url, db=db)
            closers.insert(0, policies.close)
        else:
            from kvserve.server.moderation_policy import PolicyStore
            from kvserve.server.responses_store import ResponseStore

            responses = ResponseStore(settings.db_path)
            closers.insert(0, responses.close)
            policies = PolicyStore(settings.db_path)
            closers.insert(0, policies.close)
    except BaseException:
        _close_all(closers)
        raise
    return StateBackends(keys=keys, limiter=limiter, counters=counters, conversations=convs, arena=arena,
                         responses=responses, policies=policies, _closers=closers)
