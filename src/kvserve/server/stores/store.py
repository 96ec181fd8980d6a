"""The base of every store: `SQLStore` opens its database (a SQLite file, a postgresql:// URL, or a
shared `Database`) and creates or migrates its tables. Kept apart from stores/sql.py (the SQLite
seam) and stores/postgres.py (the PostgreSQL one) so that it imports both and neither imports it."""

from __future__ import annotations

import pathlib
from typing import ClassVar

from kvserve.server.stores.common import DATABASE_SCHEMES, check_url
from kvserve.server.stores.postgres import PostgresDatabase
from kvserve.server.stores.sql import Database, SQLiteDatabase, Steps


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
