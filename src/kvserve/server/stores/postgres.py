"""PostgreSQL for the stores (`--database-url`): a small connection pool, schema migrations, and
the `Database` interface of stores/database.py on top of them.

`PostgresDatabase(url)` holds up to `size` (8) psycopg 3 connections in autocommit mode; `with
db.connection() as conn:` borrows one (a broken one is dropped, so a restarted PostgreSQL is
reconnected on the next request), and `with db.transaction() as conn:` runs a block in one
transaction. Every store of a server shares one pool.

Migrations: each store owns a *component* name and an ordered list of steps (each a tuple of SQL
statements). `migrate(db, component, steps)` runs, under a transaction-scoped advisory lock (so
replicas starting together do not race), every step past the component's version recorded in
`kvserve_schema_version`, and the new version in the same transaction: a step is applied wholly
or not at all. A database whose version is newer than this kvserve knows is refused at start.
Steps are only ever appended; an applied step is never edited.

Every connection failure on the request path is a 503 with Retry-After (StateStoreUnavailable).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

from kvserve.errors import InvalidRequest, KVServeError
from kvserve.server.stores.common import StateStoreUnavailable, redact
from kvserve.server.stores.database import Connection, Database, Steps

VERSION_TABLE = "kvserve_schema_version"
_MIGRATION_LOCK = 0x6B7673  # pg_advisory_xact_lock key shared by every kvserve ("kvs")


def _unavailable(e: Exception) -> StateStoreUnavailable:
    return StateStoreUnavailable(f"The database (PostgreSQL) is unavailable ({type(e).__name__}); retry shortly.",
                                 retry_after=2.0)


class PostgresDatabase(Database):
    """A pool of autocommit connections to one PostgreSQL database."""

    remote = True
    insert_order = "seq"      # a BIGSERIAL column stands in for SQLite's rowid
    for_update = " FOR UPDATE"
    types: ClassVar[dict[str, str]] = {"time": "DOUBLE PRECISION", "bigint": "BIGINT", "id": "BIGSERIAL PRIMARY KEY",
                                       "seq": ",\n            seq         BIGSERIAL"}

    def __init__(self, url: str, size: int = 8, connect_timeout_s: int = 5):
        import psycopg

        self.url = url
        self.size = size
        self.connect_timeout_s = connect_timeout_s
        self._idle: queue.LifoQueue = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(size)
        self._closed = False
        try:
            with self._borrow() as conn:
                conn.execute("SELECT 1")
        except psycopg.Error as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StateStoreUnavailable(f"Cannot connect to PostgreSQL at {redact(url)} ({reason}). Start it, "
                                        "or leave out --database-url to use the embedded SQLite file.") from None

    def _connect(self) -> Any:
        import psycopg
        from psycopg.rows import dict_row

        return psycopg.connect(self.url, autocommit=True, row_factory=dict_row,
                               connect_timeout=self.connect_timeout_s)

    @contextlib.contextmanager
    def connection(self) -> Iterator[Connection]:
        import psycopg

        try:
            with self._borrow() as raw:
                yield Connection(raw, conflicts=(psycopg.errors.UniqueViolation,), pyformat=True)
        except psycopg.OperationalError as e:
            raise _unavailable(e) from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Connection]:
        with self.connection() as conn, conn.raw.transaction():
            yield conn

    def schema(self, component: str, steps: Steps) -> None:
        migrate(self, component, self.render(steps))

    def lock_owner(self, conn: Connection, scope: str, owner: str) -> None:
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(?))", (f"kvserve:{scope}:{owner}",))

    def octets(self, expr: str) -> str:
        return f"octet_length({expr})"

    def check_text(self, value: object, param: str, label: str | None = None) -> None:
        """PostgreSQL text cannot hold NUL characters: a 400 rather than a 500."""
        if isinstance(value, str) and "\x00" in value:
            label = label or f"'{param}'"
            raise InvalidRequest(f"{label} contains a NUL character, which cannot be stored; remove it.",
                                 param=param)

    @contextlib.contextmanager
    def _borrow(self) -> Iterator[Any]:
        if self._closed:   # the server is shutting down
            raise StateStoreUnavailable("The server is shutting down; retry on another.", retry_after=1.0)
        self._slots.acquire()
        conn = None
        try:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                conn = self._connect()
            if conn.closed or conn.broken:
                conn = self._connect()
            yield conn
        finally:
            if conn is not None:
                if conn.broken or conn.closed or self._closed or conn.info.transaction_status != 0:
                    with contextlib.suppress(Exception):
                        conn.close()
                else:
                    self._idle.put(conn)
            self._slots.release()

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                break
            with contextlib.suppress(Exception):
                conn.close()


def migrate(db: PostgresDatabase, component: str, steps: Steps) -> int:
    """Bring `component`'s tables to the last of `steps`; returns the version now applied."""
    with db.transaction() as conn:
        conn.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
        conn.execute(f"CREATE TABLE IF NOT EXISTS {VERSION_TABLE} (component TEXT PRIMARY KEY, "
                     "version INTEGER NOT NULL, updated_at TIMESTAMPTZ NOT NULL DEFAULT now())")
        row = conn.execute(f"SELECT version FROM {VERSION_TABLE} WHERE component = ?", (component,)).fetchone()
        current = row["version"] if row else 0
        if current > len(steps):
            raise KVServeError(f"The database's {component!r} schema is version {current}, newer than this "
                               f"kvserve knows ({len(steps)}); upgrade kvserve on this machine.")
        for step in steps[current:]:
            for statement in step:
                conn.execute(statement)
        if len(steps) > current:
            conn.execute(f"INSERT INTO {VERSION_TABLE} (component, version) VALUES (?, ?) "
                         "ON CONFLICT (component) DO UPDATE SET version = excluded.version, updated_at = now()",
                         (component, len(steps)))
    return len(steps)
