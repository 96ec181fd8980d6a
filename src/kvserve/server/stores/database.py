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
    db.lock_owner(conn, scope, owner)   an owner's writes to one store serialised until the
                                        transaction ends (SQLite: the file's write lock already)
    db.data_version()                   a counter that moves when another connection commits
                                        (SQLite), or None: no cheap change signal (PostgreSQL)
    db.check_text(value, param)         a 400 for text the database cannot hold (NUL in PostgreSQL)
    db.remote                           a network round trip per call (the gateway then calls the
                                        store off the event loop)

The SQLite implementation and `SQLStore` are in sql.py, the PostgreSQL one in postgres.py.
"""

from __future__ import annotations

import contextlib
import sqlite3
import string
from typing import Any, ClassVar

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

    def lock_owner(self, conn: Connection, scope: str, owner: str) -> None:
        """Hold `owner`'s lock in `scope` until the transaction ends (a quota check and its write)."""

    def data_version(self) -> int | None:
        return None

    def check_text(self, value: object, param: str, label: str | None = None) -> None:
        pass

    def close(self) -> None:
        pass
