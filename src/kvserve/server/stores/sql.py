"""The seam between a store's rules and its database: one `Database` interface, on SQLite (the
embedded default, a file in the data dir) or PostgreSQL (`--database-url`, stores/postgres.py).

A store (`SQLStore` subclass) writes its rules and its SQL once, with `?` placeholders, and asks
the database only for what the two engines do differently:

    db.connection() / db.transaction()  a `Connection`: `execute(sql, args)` -> cursor of dict rows,
                                        `insert_id(sql, args)` -> the new row's id; a unique
                                        constraint refusing an insert raises `Conflict`
    db.schema(component, steps)         DDL steps with `$time`, `$bigint`, `$id`, `$seq` spelled per
                                        engine: SQLite runs them as `IF NOT EXISTS`; PostgreSQL as
                                        versioned migrations (postgres.migrate)
    db.insert_order                     the column that orders rows as inserted (rowid | seq)
    db.for_update                       row locks in a transaction (SQLite needs none: a
                                        transaction holds the file's write lock from BEGIN)
    db.octets(expr)                     the byte length of a text
    db.data_version()                   a counter that moves when another connection commits
                                        (SQLite), or None: no cheap change signal (PostgreSQL)
    db.check_text(value, param)         a 400 for text the database cannot hold (NUL in PostgreSQL)
    db.remote                           a network round trip per call (the gateway then calls the
                                        store off the event loop)

SQLite: one connection per store, WAL mode, guarded by a lock (FastAPI runs sync routes in a
thread pool, and SQLite serialises writes anyway); the file is made private first (sqlite_file.py).
"""

from __future__ import annotations

import contextlib
import pathlib
import sqlite3
import string
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

from kvserve.server.stores import sqlite_file
from kvserve.server.stores.common import DATABASE_SCHEMES, check_url

Steps = list[tuple[str, ...]]


class Conflict(Exception):
    """A unique constraint refused an insert (the store turns it into its own error)."""


class Connection:
    """A borrowed connection: statements with `?` placeholders, rows as dicts."""

    def __init__(self, raw: Any, *, conflicts: tuple[type[BaseException], ...], pyformat: bool):
        self.raw = raw
        self._conflicts = conflicts
        self._pyformat = pyformat

    def execute(self, sql: str, args: tuple | list = ()) -> Any:
        if self._pyformat:   # psycopg: %s placeholders, none parsed without arguments
            sql, args = sql.replace("?", "%s"), (args or None)
        try:
            return self.raw.execute(sql, args)
        except self._conflicts as e:
            if isinstance(e, sqlite3.IntegrityError) and "UNIQUE" not in str(e):
                raise
            raise Conflict(str(e)) from None

    def insert_id(self, sql: str, args: tuple | list) -> int:
        """Run an INSERT into a table with an `id` column made by the database; its new id."""
        if self._pyformat:
            return self.execute(sql + " RETURNING id", args).fetchone()["id"]
        return self.execute(sql, args).lastrowid


class Database:
    """What a store may ask of its database (see the module's docstring)."""

    remote = False
    insert_order = "rowid"
    for_update = ""
    types: ClassVar[dict[str, str]] = {"time": "REAL", "bigint": "INTEGER",
                                       "id": "INTEGER PRIMARY KEY AUTOINCREMENT", "seq": ""}

    def connection(self) -> contextlib.AbstractContextManager[Connection]:
        raise NotImplementedError

    def transaction(self) -> contextlib.AbstractContextManager[Connection]:
        raise NotImplementedError

    def schema(self, component: str, steps: Steps) -> None:
        raise NotImplementedError

    def render(self, steps: Steps) -> Steps:
        """The steps' DDL in this engine's types."""
        return [tuple(string.Template(stmt).substitute(self.types) for stmt in step) for step in steps]

    def octets(self, expr: str) -> str:
        return f"length(CAST({expr} AS BLOB))"

    def data_version(self) -> int | None:
        return None

    def check_text(self, value: object, param: str, label: str | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def _dict_row(cursor: sqlite3.Cursor, row: tuple) -> dict[str, Any]:
    return {col[0]: value for col, value in zip(cursor.description, row)}


class SQLiteDatabase(Database):
    """One SQLite connection (WAL, foreign keys on, 10 s busy timeout) behind a lock."""

    def __init__(self, path: pathlib.Path | str):
        self.path = pathlib.Path(path)
        self._lock = threading.Lock()
        self._conn = sqlite_file.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10.0)
        self._conn.row_factory = _dict_row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")   # durable across a process kill in WAL mode
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._wrapped = Connection(self._conn, conflicts=(sqlite3.IntegrityError,), pyformat=False)

    @contextlib.contextmanager
    def connection(self) -> Iterator[Connection]:
        with self._lock:
            yield self._wrapped

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._wrapped
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def schema(self, component: str, steps: Steps) -> None:
        """Every statement of every step, each `CREATE ... IF NOT EXISTS` (SQLite files keep no
        version table: a step that alters a table needs one first)."""
        with self._lock:
            for step in self.render(steps):
                for statement in step:
                    self._conn.execute(statement)

    def data_version(self) -> int | None:
        with self._lock:
            return self._conn.execute("PRAGMA data_version").fetchone()["data_version"]

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def open_database(target: Database | pathlib.Path | str) -> tuple[Database, bool]:
    """`target` as a Database, and whether the caller owns (closes) it: a Database is shared; a
    postgresql:// URL opens a pool (stores/postgres.py); anything else is a SQLite file's path."""
    if isinstance(target, Database):
        return target, False
    if isinstance(target, str) and "://" in target:
        from kvserve.server.stores.postgres import PostgresDatabase

        return PostgresDatabase(check_url(target, "--database-url", DATABASE_SCHEMES)), True
    return SQLiteDatabase(target), True


class SQLStore:
    """What every store shares: its database (opened from a path or URL, or a shared one it does
    not close) and its tables, created or migrated at open from its `component`'s `steps`."""

    component: ClassVar[str] = ""
    steps: ClassVar[Steps] = []

    def __init__(self, db: Database | pathlib.Path | str):
        self.db, self._owns_db = open_database(db)
        try:
            self.db.schema(self.component, self.steps)
        except BaseException:
            self.close()
            raise

    @property
    def remote(self) -> bool:
        return self.db.remote

    def close(self) -> None:
        if self._owns_db:
            self.db.close()

