"""Stored Responses (`POST /v1/responses` with `store: true`), per owner, in the server's SQLite file
or in PostgreSQL with --database-url (so a response created through one server can be continued
with `previous_response_id`, read or deleted through another).

Four calls: `put(owner, response, messages)`, `get(owner, id)`, `messages(owner, id)` and
`delete(owner, id)`. `messages` is the conversation up to and including that response's answer,
as chat messages without the instructions (OpenAI does not carry `instructions` over a
`previous_response_id`); the next request's context is built from it (server/generation/context.py).
An owner sees only its own responses: another owner's id is a 404, as is an unknown one. The
response and its conversation are JSON text (json.dumps escapes a NUL character, which
PostgreSQL's TEXT cannot hold); storing an id again replaces it.

Each owner's stored responses are under a quota (stores/quota.py: items, bytes of the response and
its conversation, and OpenAI's 30-day expiry): past it, `put` is a 413 and nothing is stored; an
expired response reads as unknown (404).
"""

from __future__ import annotations

import json
import time
from typing import Any

from kvserve.errors import KVServeError
from kvserve.server.stores.quota import DEFAULT_QUOTAS, OwnerQuota, QuotaLimits
from kvserve.server.stores.sql import SQLStore, Steps


class ResponseNotFound(KVServeError, status=404, code="not_found"):
    """No stored response with this id for this caller (HTTP 404)."""


STEPS: Steps = [
    (  # 1
        """CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at $time NOT NULL,
    response TEXT NOT NULL,
    messages TEXT NOT NULL
)""",
        "CREATE INDEX IF NOT EXISTS responses_owner ON responses (owner, created_at)",
    ),
]


class ResponseStore(SQLStore):
    component, steps = "responses", STEPS

    def __init__(self, db, quota: QuotaLimits | None = None):
        self.quota = OwnerQuota("responses", quota or DEFAULT_QUOTAS["responses"], what="stored responses",
                                param="store", text_columns=("response", "messages"))
        super().__init__(db)

    def put(self, owner: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Store (or replace) a response; 413 past the owner's quota."""
        response_text, messages_text = json.dumps(response), json.dumps(messages)
        size = len(response_text.encode()) + len(messages_text.encode())
        with self.db.transaction() as conn:
            self.quota.admit(self.db, conn, owner, size, replacing=response["id"])
            conn.execute("INSERT INTO responses (id, owner, created_at, response, messages) VALUES (?, ?, ?, ?, ?) "
                         "ON CONFLICT (id) DO UPDATE SET owner = excluded.owner, created_at = excluded.created_at, "
                         "response = excluded.response, messages = excluded.messages",
                         (response["id"], owner, time.time(), response_text, messages_text))

    def _column(self, owner: str, response_id: str, column: str) -> Any:
        alive, args = self.quota.alive()
        with self.db.connection() as conn:
            row = conn.execute(f"SELECT {column} FROM responses WHERE id = ? AND owner = ?{alive}",
                               (response_id, owner, *args)).fetchone()
        if row is None:
            raise ResponseNotFound(f"No response with id {response_id!r} (stored responses are visible only to "
                                   "the key that created them).", param="response_id")
        return json.loads(row[column])

    def get(self, owner: str, response_id: str) -> dict[str, Any]:
        return self._column(owner, response_id, "response")

    def messages(self, owner: str, response_id: str) -> list[dict[str, Any]]:
        return self._column(owner, response_id, "messages")

    def delete(self, owner: str, response_id: str) -> None:
        with self.db.connection() as conn:
            alive, args = self.quota.alive()
            cur = conn.execute(f"DELETE FROM responses WHERE id = ? AND owner = ?{alive}", (response_id, owner, *args))
        if cur.rowcount == 0:
            raise ResponseNotFound(f"No response with id {response_id!r}.", param="response_id")
