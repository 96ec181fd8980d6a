"""`SQLStore`, what every store shares, and the embedded database: the `Database` interface
(database.py) on SQLite, or a PostgreSQL pool (postgres.py) when given a postgresql:// URL.

SQLite: one connection per store, WAL mode, guarded by a lock (FastAPI runs sync routes in a
thread pool, and SQLite serialises writes anyway); the file is made private first (sqlite_file.py).
"""

from __future__ import annotations

import contextlib
import pathlib
import sqlite3
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

from kvserve.server.stores import sqlite_file
from kvserve.server.stores.common import DATABASE_SCHEMES, check_url
from kvserve.server.stores.database import Conflict, Connection, Database, Steps
from kvserve.server.stores.postgres import PostgresDatabase

__all__ = ["Conflict", "Connection", "Database", "SQLStore", "SQLiteDatabase", "Steps", "open_database"]


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

