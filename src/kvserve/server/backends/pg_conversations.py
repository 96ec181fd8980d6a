"""Saved conversations in PostgreSQL: conversations.ConversationStore's API, rules and limits.

The validation (titles, roles, JSON fields, caps) and the response shapes are the SQLite store's,
inherited; only the SQL differs. Writes that check a quota run in one transaction holding row
locks, so replicas writing for the same owner at once cannot overshoot it: `put_messages` and
`delete` lock the conversation, then the owner's `owner_usage` row; `create` locks the owner's
row (the per-owner conversation cap). PostgreSQL text cannot hold NUL characters, so a title or
message containing one is refused with a 400 (JSON fields escape it and are stored as sent).
"""

from __future__ import annotations

import secrets
import time

from kvserve.errors import InvalidRequest
from kvserve.server.backends.postgres import Database, PostgresStore, pg_errors
from kvserve.server.conversations import ConversationNotFound, ConversationStore, QuotaExceeded, StoreLimits

COMPONENT = "conversations"
MIGRATIONS: list[tuple[str, ...]] = [
    (  # 1: the tables of conversations._SCHEMA (`seq` stands in for SQLite's rowid in list order)
        """CREATE TABLE conversations (
            id          TEXT PRIMARY KEY,
            owner       TEXT NOT NULL,
            title       TEXT NOT NULL,
            model       TEXT,
            settings    TEXT NOT NULL DEFAULT '{}',
            created_at  DOUBLE PRECISION NOT NULL,
            updated_at  DOUBLE PRECISION NOT NULL,
            seq         BIGSERIAL)""",
        "CREATE INDEX conversations_owner ON conversations (owner, updated_at DESC)",
        "CREATE TABLE owner_usage (owner TEXT PRIMARY KEY, bytes BIGINT NOT NULL DEFAULT 0)",
        """CREATE TABLE messages (
            id              BIGSERIAL PRIMARY KEY,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            position        INTEGER NOT NULL,
            role            TEXT NOT NULL,
            content         TEXT NOT NULL,
            trace           TEXT,
            meta            TEXT,
            created_at      DOUBLE PRECISION NOT NULL,
            UNIQUE (conversation_id, position))""",
    ),
]

_ROW_BYTES = ("COALESCE(SUM(octet_length(content) + COALESCE(length(trace), 0) + COALESCE(length(meta), 0)), 0)"
              " AS bytes")


def _no_nul(value: object, param: str) -> None:
    if isinstance(value, str) and "\x00" in value:
        raise InvalidRequest(f"'{param}' contains a NUL character, which cannot be stored; remove it.",
                             param=param)


class PostgresConversationStore(PostgresStore, ConversationStore):
    component, migrations = COMPONENT, MIGRATIONS

    def __init__(self, url: str, limits: StoreLimits | None = None, *, db: Database | None = None):
        self.limits = limits or StoreLimits()
        super().__init__(url, db=db)

    def _title(self, title: object) -> str:
        _no_nul(title, "title")
        return super()._title(title)

    def _message_row(self, msg: object, i: int) -> tuple[str, str, str | None, str | None]:
        row = super()._message_row(msg, i)
        _no_nul(row[1], f"messages[{i}].content")
        return row

    @staticmethod
    def _owned_in(conn, owner: str, conv_id: str, lock: bool = False) -> dict:
        row = conn.execute("SELECT * FROM conversations WHERE id = %s AND owner = %s"
                           + (" FOR UPDATE" if lock else ""), (conv_id, owner)).fetchone()
        if row is None:
            raise ConversationNotFound(f"No conversation '{conv_id}'; list yours with "
                                       "GET /v1/kvserve/conversations.", param="conversation_id")
        return row

    @staticmethod
    def _lock_usage(conn, owner: str) -> int:
        conn.execute("INSERT INTO owner_usage (owner, bytes) VALUES (%s, 0) ON CONFLICT (owner) DO NOTHING",
                     (owner,))
        return conn.execute("SELECT bytes FROM owner_usage WHERE owner = %s FOR UPDATE", (owner,)).fetchone()["bytes"]

    @staticmethod
    def _add_usage_in(conn, owner: str, delta: int) -> None:
        conn.execute("UPDATE owner_usage SET bytes = GREATEST(0, bytes + %s) WHERE owner = %s", (delta, owner))

    @pg_errors
    def usage_bytes(self, owner: str) -> int:
        with self.db.connection() as conn:
            row = conn.execute("SELECT bytes FROM owner_usage WHERE owner = %s", (owner,)).fetchone()
        return int(row["bytes"]) if row else 0

    @pg_errors
    def list(self, owner: str) -> list[dict]:
        with self.db.connection() as conn:
            rows = conn.execute("SELECT * FROM conversations WHERE owner = %s ORDER BY updated_at DESC, seq DESC",
                                (owner,)).fetchall()
        return [self._conv_dict(r) for r in rows]

    @pg_errors
    def create(self, owner: str, title: str = "New chat", model: str | None = None,
               settings: dict | None = None) -> dict:
        title = self._title(title)
        if model is not None and not isinstance(model, str):
            raise InvalidRequest("'model' must be a string.", param="model")
        _no_nul(model, "model")
        settings_text = self._json_field(settings or {}, "settings", self.limits.max_settings_bytes)
        conv_id = "conv_" + secrets.token_hex(12)
        now = time.time()
        with self.db.transaction() as conn:
            self._lock_usage(conn, owner)
            count = conn.execute("SELECT COUNT(*) AS n FROM conversations WHERE owner = %s", (owner,)).fetchone()["n"]
            if count >= self.limits.max_conversations_per_owner:
                raise InvalidRequest(f"You have {count} conversations, the maximum; delete some first.",
                                     param="conversation_id")
            row = conn.execute(
                "INSERT INTO conversations (id, owner, title, model, settings, created_at, updated_at) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING *",
                (conv_id, owner, title, model, settings_text, now, now)).fetchone()
        return self._conv_dict(row)

    @pg_errors
    def get(self, owner: str, conv_id: str) -> dict:
        with self.db.transaction() as conn:
            conv = self._owned_in(conn, owner, conv_id)
            msgs = conn.execute("SELECT * FROM messages WHERE conversation_id = %s ORDER BY position",
                                (conv_id,)).fetchall()
        return {**self._conv_dict(conv), "messages": [self._msg_dict(m) for m in msgs]}

    @pg_errors
    def update(self, owner: str, conv_id: str, *, title: object = None, model: object = None,
               settings: object = None) -> dict:
        sets: list[str] = []
        args: list[object] = []
        if title is not None:
            sets.append("title = %s")
            args.append(self._title(title))
        if model is not None:
            if not isinstance(model, str):
                raise InvalidRequest("'model' must be a string.", param="model")
            _no_nul(model, "model")
            sets.append("model = %s")
            args.append(model)
        if settings is not None:
            sets.append("settings = %s")
            args.append(self._json_field(settings, "settings", self.limits.max_settings_bytes))
        with self.db.transaction() as conn:
            self._owned_in(conn, owner, conv_id, lock=True)
            if sets:
                conn.execute(f"UPDATE conversations SET {', '.join(sets)}, updated_at = %s "
                             "WHERE id = %s AND owner = %s", (*args, time.time(), conv_id, owner))
            row = self._owned_in(conn, owner, conv_id)
        return self._conv_dict(row)

    @pg_errors
    def delete(self, owner: str, conv_id: str) -> None:
        with self.db.transaction() as conn:
            self._owned_in(conn, owner, conv_id, lock=True)
            self._lock_usage(conn, owner)
            freed = conn.execute(f"SELECT {_ROW_BYTES} FROM messages WHERE conversation_id = %s",
                                 (conv_id,)).fetchone()["bytes"]
            conn.execute("DELETE FROM conversations WHERE id = %s AND owner = %s", (conv_id, owner))
            self._add_usage_in(conn, owner, -int(freed))

    @pg_errors
    def put_messages(self, owner: str, conv_id: str, messages: object, *, start: int | None = None) -> dict:
        """See ConversationStore.put_messages; one transaction, the quota checked under row locks."""
        if not isinstance(messages, list):
            raise InvalidRequest("'messages' must be a list of {role, content} objects.", param="messages")
        if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 0):
            raise InvalidRequest("'start' must be a non-negative integer.", param="start")
        rows = [self._message_row(m, i) for i, m in enumerate(messages)]
        now = time.time()
        with self.db.transaction() as conn:
            self._owned_in(conn, owner, conv_id, lock=True)
            used = int(self._lock_usage(conn, owner))
            count = conn.execute("SELECT COUNT(*) AS n FROM messages WHERE conversation_id = %s",
                                 (conv_id,)).fetchone()["n"]
            if start is None:
                start = count
            if start > count:
                raise InvalidRequest(f"'start' is {start} but the conversation has {count} messages.",
                                     param="start")
            if start + len(rows) > self.limits.max_messages_per_conversation:
                raise InvalidRequest("This conversation has reached the maximum of "
                                     f"{self.limits.max_messages_per_conversation} messages; start a new "
                                     "chat.", param="messages")
            added = sum(len(c.encode()) + len(t or "") + len(m or "") for _, c, t, m in rows)
            freed = int(conn.execute(f"SELECT {_ROW_BYTES} FROM messages WHERE conversation_id = %s "
                                     "AND position >= %s", (conv_id, start)).fetchone()["bytes"])
            if added > freed and used - freed + added > self.limits.max_owner_bytes:
                raise QuotaExceeded(f"Your saved conversations would take {used - freed + added} bytes; the "
                                    f"quota is {self.limits.max_owner_bytes}. Delete old conversations first.",
                                    param="messages")
            conn.execute("DELETE FROM messages WHERE conversation_id = %s AND position >= %s", (conv_id, start))
            ids = []
            for i, row in enumerate(rows):
                ids.append(conn.execute(
                    "INSERT INTO messages (conversation_id, position, role, content, trace, meta, created_at) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id", (conv_id, start + i, *row, now)
                ).fetchone()["id"])
            conn.execute("UPDATE conversations SET updated_at = %s WHERE id = %s", (now, conv_id))
            self._add_usage_in(conn, owner, added - freed)
        return {"id": conv_id, "object": "kvserve.conversation.messages", "start": start,
                "total": start + len(rows),
                "messages": [{"id": mid, "position": start + i, "role": row[0], "created_at": now}
                             for i, (mid, row) in enumerate(zip(ids, rows))]}
