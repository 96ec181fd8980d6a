"""The seam under every store (server/stores/sql.py): one store's SQL, written once, runs on
SQLite and on PostgreSQL with the same results."""

from __future__ import annotations

import pytest

from kvserve.errors import InvalidRequest
from kvserve.server.stores.sql import Conflict, SQLStore

STEPS = [(
    """CREATE TABLE IF NOT EXISTS test_notes (
    id      $id,
    name    TEXT NOT NULL UNIQUE,
    at      $time NOT NULL,
    hits    $bigint NOT NULL DEFAULT 0$seq
)""",
)]


class Notes(SQLStore):
    """A throwaway store that uses each part of the seam."""

    component, steps = "test_notes", STEPS

    def add(self, name: str, at: float) -> int:
        self.db.check_text(name, "name")
        with self.db.connection() as conn:
            return conn.insert_id("INSERT INTO test_notes (name, at) VALUES (?, ?)", (name, at))

    def names(self) -> list[str]:
        with self.db.connection() as conn:
            rows = conn.execute(f"SELECT name FROM test_notes ORDER BY at, {self.db.insert_order}").fetchall()
        return [r["name"] for r in rows]


@pytest.fixture(params=("sqlite", "postgres"))
def notes(request, tmp_path):
    target = request.getfixturevalue("postgres_server").new_database() if request.param == "postgres" \
        else tmp_path / "kvserve.db"
    store = Notes(target)
    yield store
    store.close()


def test_one_store_runs_on_either_database(notes):
    first, second = notes.add("b", 1.0), notes.add("a", 1.0)
    assert second > first
    assert notes.names() == ["b", "a"]   # ties in insertion order (rowid / seq)
    with pytest.raises(Conflict):
        notes.add("a", 2.0)
    with pytest.raises(RuntimeError), notes.db.transaction() as conn:   # a failed block leaves nothing
        conn.execute("UPDATE test_notes SET hits = hits + 1")
        conn.execute("INSERT INTO test_notes (name, at) VALUES (?, ?)", ("c", 3.0))
        raise RuntimeError
    with notes.db.connection() as conn:
        rows = conn.execute("SELECT name, hits FROM test_notes ORDER BY name").fetchall()
    assert rows == [{"name": "a", "hits": 0}, {"name": "b", "hits": 0}]
    assert notes.db.remote == (notes.db.data_version() is None)
    Notes(notes.db).close()   # a store on a shared database leaves it open
    assert notes.names() == ["b", "a"]


def test_text_a_database_cannot_hold_is_a_400(notes):
    if notes.db.remote:
        with pytest.raises(InvalidRequest, match="'name' contains a NUL"):
            notes.add("a\x00b", 1.0)
    else:
        notes.add("a\x00b", 1.0)
        assert notes.names() == ["a\x00b"]
