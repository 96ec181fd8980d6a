"""Stored Responses (the Responses API, `store: true`) in PostgreSQL: responses_store.ResponseStore's
four calls, so a response created through one server can be continued (`previous_response_id`),
read or deleted through another. The response and its conversation are JSON text, as in SQLite
(json.dumps escapes a NUL character, which PostgreSQL's TEXT and JSONB cannot hold); an owner sees
only its own rows (another owner's id is the same 404 as an unknown one)."""

from __future__ import annotations

import json
import time
from typing import Any

from kvserve.server.backends.postgres import PostgresStore, pg_errors
from kvserve.server.responses_store import ResponseNotFound

COMPONENT = "responses"
MIGRATIONS: list[tuple[str, ...]] = [
    (  # 1: responses_store.SCHEMA
        """CREATE TABLE responses (
            id          TEXT PRIMARY KEY,
            owner       TEXT NOT NULL,
            created_at  DOUBLE PRECISION NOT NULL,
            response    TEXT NOT NULL,
            messages    TEXT NOT NULL)""",
        "CREATE INDEX responses_owner ON responses (owner, created_at)",
    ),
]


class PostgresResponseStore(PostgresStore):
    component, migrations = COMPONENT, MIGRATIONS

    @pg_errors
    def put(self, owner: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        with self.db.connection() as conn:
            conn.execute("INSERT INTO responses (id, owner, created_at, response, messages) VALUES (%s, %s, %s, %s, %s) "
                         "ON CONFLICT (id) DO UPDATE SET owner = excluded.owner, created_at = excluded.created_at, "
                         "response = excluded.response, messages = excluded.messages",
                         (response["id"], owner, time.time(), json.dumps(response), json.dumps(messages)))

    def _row(self, owner: str, response_id: str, column: str) -> Any:
        with self.db.connection() as conn:
            row = conn.execute(f"SELECT {column} FROM responses WHERE id = %s AND owner = %s",
                               (response_id, owner)).fetchone()
        if row is None:
            raise ResponseNotFound(f"No response with id {response_id!r} (stored responses are visible only to "
                                   "the key that created them).", param="response_id")
        return json.loads(row[column])

    @pg_errors
    def get(self, owner: str, response_id: str) -> dict[str, Any]:
        return self._row(owner, response_id, "response")

    @pg_errors
    def messages(self, owner: str, response_id: str) -> list[dict[str, Any]]:
        return self._row(owner, response_id, "messages")

    @pg_errors
    def delete(self, owner: str, response_id: str) -> None:
        with self.db.connection() as conn:
            cur = conn.execute("DELETE FROM responses WHERE id = %s AND owner = %s", (response_id, owner))
        if cur.rowcount == 0:
            raise ResponseNotFound(f"No response with id {response_id!r}.", param="response_id")
