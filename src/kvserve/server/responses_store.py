"""Stored Responses (`POST /v1/responses` with `store: true`), per owner, in the server's SQLite file.

The interface is four calls (backends/base.ResponseBackend; PostgreSQL with --database-url is
backends/pg_responses.py, picked by backends/factory.py): `put(owner, response, messages)`, `get(owner, id)`, `messages(owner, id)` and
`delete(owner, id)`. `messages` is the conversation up to and including that response's answer,
as chat messages without the instructions (OpenAI does not carry `instructions` over a
`previous_response_id`); the next request's context is built from it (server/context.py).
An owner sees only its own responses: another owner's id is a 404, as is an unknown one.
All SQL of this store is in this module.
"""

from __future__ import annotations

import json
import pathlib
import threading
import time
from typing import Any

from kvserve.errors import KVServeError
from kvserve.server import storage

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    messages TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_owner ON responses (owner, created_at);
"""


class ResponseNotFound(KVServeError):
    status = 404
    code = "not_found"


class ResponseStore:
    def __init__(self, db_path: pathlib.Path):
        self._lock = threading.Lock()
        self._conn = storage.connect(pathlib.Path(db_path), check_same_thread=False, isolation_level=None,
                                     timeout=10.0)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def put(self, owner: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO responses (id, owner, created_at, response, messages) "
                               "VALUES (?, ?, ?, ?, ?)", (response["id"], owner, time.time(), json.dumps(response),
                                                          json.dumps(messages)))

    def _row(self, owner: str, response_id: str, column: str) -> Any:
        with self._lock:
            row = self._conn.execute(f"SELECT {column} FROM responses WHERE id = ? AND owner = ?",
                                     (response_id, owner)).fetchone()
        if row is None:
            raise ResponseNotFound(f"No response with id {response_id!r} (stored responses are visible only to "
                                   "the key that created them).", param="response_id")
        return json.loads(row[0])

    def get(self, owner: str, response_id: str) -> dict[str, Any]:
        return self._row(owner, response_id, "response")

    def messages(self, owner: str, response_id: str) -> list[dict[str, Any]]:
        return self._row(owner, response_id, "messages")

    def delete(self, owner: str, response_id: str) -> None:
        with self._lock:
            cur = self._conn.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        if cur.rowcount == 0:
            raise ResponseNotFound(f"No response with id {response_id!r}.", param="response_id")
