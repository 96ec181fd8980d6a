"""The interfaces of the server's stores, and `open_backends`, which picks their implementations.

The embedded implementations (keys.KeyStore, ratelimit.RateLimiter, conversations.ConversationStore,
counters.MemoryCounters) are the reference: every other backend passes the same tests
(tests/server/test_gateway.py, test_conversations.py and tests/server/backends/, parametrized over
the backends). Redis and psycopg are imported only when their URL is given.
"""

from __future__ import annotations

import logging
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvserve.errors import InvalidRequest, Overloaded

logger = logging.getLogger("kvserve.server")

if TYPE_CHECKING:
    from kvserve.server.conversations import StoreLimits
    from kvserve.server.keys import ApiKey
    from kvserve.server.settings import ServerSettings


class StateStoreUnavailable(Overloaded):
    """Redis or PostgreSQL cannot be reached (HTTP 503 with Retry-After)."""

    code = "state_store_unavailable"


class KeyBackend(Protocol):
    """API keys (stored as SHA-256 hashes) and the usage ledger (per key per UTC day)."""

    def create(self, name: str, *, tier: str = "paid", rpm: int | None = None,
               tpm: int | None = None) -> str: ...
    def revoke(self, name: str) -> bool: ...
    def list(self) -> list[ApiKey]: ...
    def auth_required(self) -> bool: ...
    def lookup(self, presented: str) -> ApiKey | None: ...
    def record_usage(self, key_name: str | None, prompt_tokens: int, completion_tokens: int,
                     cached_tokens: int, *, requests: int = 1) -> None: ...
    def usage(self, key_name: str | None = None) -> list[dict]: ...
    def close(self) -> None: ...


class RateLimitBackend(Protocol):
    """Token buckets per key: requests per minute and tokens per minute (ratelimit.py)."""

    def acquire_request(self, key_name: str, rpm: int | None) -> None: ...
    def reserve_tokens(self, key_name: str, tpm: int | None, amount: int) -> int: ...
    def refund_tokens(self, key_name: str, tpm: int | None, amount: int) -> None: ...
    def headers(self, key_name: str, rpm: int | None, tpm: int | None) -> list[tuple[bytes, bytes]]: ...


class ConversationBackend(Protocol):
    """The web page's saved conversations, scoped by owner (conversations.py)."""

    limits: StoreLimits

    def list(self, owner: str) -> list[dict]: ...
    def create(self, owner: str, title: str = "New chat", model: str | None = None,
               settings: dict | None = None) -> dict: ...
    def get(self, owner: str, conv_id: str) -> dict: ...
    def update(self, owner: str, conv_id: str, *, title: object = None, model: object = None,
               settings: object = None) -> dict: ...
    def delete(self, owner: str, conv_id: str) -> None: ...
    def put_messages(self, owner: str, conv_id: str, messages: object, *, start: int | None = None) -> dict: ...
    def close(self) -> None: ...


class CounterBackend(Protocol):
    """Live counters (cumulative, named), shared by every replica when they are in Redis."""

    def incr(self, name: str, amount: int = 1) -> None: ...
    def snapshot(self) -> dict[str, int]: ...
    def close(self) -> None: ...


def redact(url: str) -> str:
    """A URL without its password, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc[0].split(":")[0] + ":***@" + netloc[1]))


def check_url(url: str, option: str, schemes: tuple[str, ...]) -> str:
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in schemes:
        raise InvalidRequest(f"{option} must be a {' or '.join(s + '://' for s in schemes)} URL, got "
                           f"{redact(url)!r}.", param=option)
    return url


DATABASE_SCHEMES = ("postgresql", "postgres")
REDIS_SCHEMES = ("redis", "rediss", "unix")


@dataclass
class StateBackends:
    """The stores one server uses; `close()` closes all of them."""

    keys: KeyBackend
    limiter: RateLimitBackend
    counters: CounterBackend
    conversations: ConversationBackend | None = None
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
    pool `db` when given); with Redis, changes also invalidate the servers' key-lookup cache at once."""
    if database_url:
        from kvserve.server.backends.pg_keys import PostgresKeyStore

        store: Any = PostgresKeyStore(check_url(database_url, "--database-url", DATABASE_SCHEMES), db=db)
    else:
        from kvserve.server.keys import KeyStore

        store = KeyStore(db_path)
    if redis_url or redis_client is not None:
        from kvserve.server.backends.redis_state import CachedKeyStore, connect_redis

        client = redis_client or connect_redis(check_url(redis_url, "--redis-url", REDIS_SCHEMES))
        store = CachedKeyStore(store, client, owns_client=redis_client is None)
    return store


def open_backends(settings: ServerSettings, *, conversations: bool = True) -> StateBackends:
    """The stores `settings` asks for: the embedded ones unless --database-url / --redis-url."""
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
        if conversations:
            if settings.database_url:
                from kvserve.server.backends.pg_conversations import PostgresConversationStore

                convs = PostgresConversationStore(settings.database_url, settings.store_limits(), db=db)
            else:
                from kvserve.server.conversations import ConversationStore

                convs = ConversationStore(settings.db_path, settings.store_limits())
            closers.insert(0, convs.close)
        # Stored responses (the Responses API) plug in here the same way: SQLite by default,
        # pg_responses.PostgresResponseStore when settings.database_url is set.
    except BaseException:
        _close_all(closers)
        raise
    return StateBackends(keys=keys, limiter=limiter, counters=counters, conversations=convs,
                         _closers=closers)
