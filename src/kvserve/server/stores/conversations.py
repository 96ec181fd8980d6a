"""Saved chat conversations for the web page, in the server's SQLite file or PostgreSQL.

Layout (three tables):

    conversations(id, owner, title, model, settings JSON, created_at, updated_at)
    messages(id, conversation_id → conversations.id ON DELETE CASCADE, position, role,
             content, trace JSON | NULL, meta JSON | NULL, created_at)
    owner_usage(owner, bytes)

Every read and write is scoped by `owner`, a string the web layer derives from the caller:
`key:<api key name>` when the server runs with auth, `client:<browser id>` when it does not.
A conversation that belongs to another owner is indistinguishable from one that does not
exist (both raise ConversationNotFound), so ids leak nothing across owners.

Each owner has a storage quota (`StoreLimits.max_owner_bytes`, the bytes of their messages'
content, traces and meta, kept in `owner_usage` by every write and delete): past it, 413
`storage_quota_exceeded`, which says to delete old conversations. Writes that check a quota or
a cap run in one transaction that holds the rows they read (SQLite: the file's write lock;
PostgreSQL: row locks, the conversation's and then the owner's `owner_usage` row), so servers
writing for the same owner at once cannot overshoot it.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

from kvserve.errors import InvalidRequest, KVServeError
from kvserve.server.stores.quota import QuotaExceeded
from kvserve.server.stores.sql import Connection, SQLStore, Steps

__all__ = ["ConversationNotFound", "ConversationStore", "QuotaExceeded", "StoreLimits"]

ROLES = ("system", "user", "assistant", "tool")   # "tool": a tool call's result (meta.tool_call_id)

STEPS: Steps = [
    (  # 1 ($seq: PostgreSQL's stand-in for SQLite's rowid in list order)
        """CREATE TABLE IF NOT EXISTS conversations (
    id          TEXT PRIMARY KEY,
    owner       TEXT NOT NULL,
    title       TEXT NOT NULL,
    model       TEXT,
    settings    TEXT NOT NULL DEFAULT '{}',
    created_at  $time NOT NULL,
    updated_at  $time NOT NULL$seq
)""",
        """CREATE TABLE IF NOT EXISTS owner_usage (
    owner TEXT PRIMARY KEY,
    bytes $bigint NOT NULL DEFAULT 0
)""",
        "CREATE INDEX IF NOT EXISTS conversations_owner ON conversations(owner, updated_at DESC)",
        """CREATE TABLE IF NOT EXISTS messages (
    id              $id,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    position        INTEGER NOT NULL,
    role            TEXT NOT NULL,
    content         TEXT NOT NULL,
    trace           TEXT,
    meta            TEXT,
    created_at      $time NOT NULL,
    UNIQUE (conversation_id, position)
)""",
    ),
]


class ConversationNotFound(KVServeError, status=404, code="conversation_not_found"):
    """No conversation with this id for this caller (HTTP 404)."""


@dataclass
class StoreLimits:
    """Caps that keep one caller from filling the disk through the page's API."""

    max_title_chars: int = 200
    max_content_chars: int = 200_000
    max_trace_bytes: int = 4_000_000
    max_meta_bytes: int = 16_000
    max_settings_bytes: int = 16_000
    max_messages_per_conversation: int = 2_000
    max_conversations_per_owner: int = 2_000
    max_owner_bytes: int = 64 << 20      # all of an owner's messages (content + trace + meta)
    max_body_bytes: int = 8 << 20        # one request's body (a message's trace can be 4 MB)
    body_timeout_s: float = 30.0
    max_json_depth: int = 64


class ConversationStore(SQLStore):
    """The conversations of every owner on one database (see the module's docstring)."""

    component, steps = "conversations", STEPS

    def __init__(self, db, limits: StoreLimits | None = None):
        self.limits = limits or StoreLimits()
        super().__init__(db)

    # ---- validation helpers -------------------------------------------------------------

    def _title(self, title: object) -> str:
        if not isinstance(title, str):
            raise InvalidRequest("'title' must be a string.", param="title")
        self.db.check_text(title, "title")
        title = " ".join(title.split())
        if len(title) > self.limits.max_title_chars:
            raise InvalidRequest(f"'title' is longer than {self.limits.max_title_chars} characters; "
                                 "shorten it.", param="title")
        return title or "New chat"

    def _model(self, model: object) -> None:
        if not isinstance(model, str):
            raise InvalidRequest("'model' must be a string.", param="model")
        self.db.check_text(model, "model")

    def _json_field(self, value: object, name: str, max_bytes: int) -> str | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise InvalidRequest(f"'{name}' must be a JSON object.", param=name)
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        if len(text.encode()) > max_bytes:
            raise InvalidRequest(f"'{name}' is larger than {max_bytes} bytes; send a smaller one.",
                                 param=name)
        return text

    def _message_row(self, msg: object, i: int) -> tuple[str, str, str | None, str | None]:
        if not isinstance(msg, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content'.",
                                 param=f"messages[{i}]")
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}.",
                                 param=f"messages[{i}].role")
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string.", param=f"messages[{i}].content")
        if len(content) > self.limits.max_content_chars:
            raise InvalidRequest(f"messages[{i}].content is longer than {self.limits.max_content_chars} "
                                 "characters.", param=f"messages[{i}].content")
        self.db.check_text(content, f"messages[{i}].content")
        trace = self._json_field(msg.get("trace"), f"messages[{i}].trace", self.limits.max_trace_bytes)
        meta = self._json_field(msg.get("meta"), f"messages[{i}].meta", self.limits.max_meta_bytes)
        return role, content, trace, meta

    @staticmethod
    def _conv_dict(row: dict) -> dict:
        return {"id": row["id"], "object": "kvserve.conversation", "title": row["title"],
                "model": row["model"], "settings": json.loads(row["settings"]),
                "created_at": row["created_at"], "updated_at": row["updated_at"]}

    @staticmethod
    def _msg_dict(row: dict) -> dict:
        return {"id": row["id"], "position": row["position"], "role": row["role"],
                "content": row["content"],
                "trace": json.loads(row["trace"]) if row["trace"] else None,
                "meta": json.loads(row["meta"]) if row["meta"] else None,
                "created_at": row["created_at"]}

    # ---- reads and locks inside one connection ----------------------------------------------

    def _owned(self, conn: Connection, owner: str, conv_id: str, lock: bool = False) -> dict:
        row = conn.execute("SELECT * FROM conversations WHERE id = ? AND owner = ?"
                           + (self.db.for_update if lock else ""), (conv_id, owner)).fetchone()
        if row is None:
            raise ConversationNotFound(f"No conversation '{conv_id}'; list yours with "
                                       "GET /v1/kvserve/conversations.", param="conversation_id")
        return row

    def _lock_usage(self, conn: Connection, owner: str) -> int:
        """The owner's stored bytes, their row locked until the transaction ends."""
        conn.execute("INSERT INTO owner_usage (owner, bytes) VALUES (?, 0) ON CONFLICT (owner) DO NOTHING", (owner,))
        return int(conn.execute("SELECT bytes FROM owner_usage WHERE owner = ?" + self.db.for_update,
                                (owner,)).fetchone()["bytes"])

    def _bytes_from(self, conn: Connection, conv_id: str, start: int = 0) -> int:
        """The bytes of the conversation's messages at or after `start` (content, trace, meta)."""
        octets = self.db.octets("content")
        return int(conn.execute(f"SELECT COALESCE(SUM({octets} + COALESCE(length(trace), 0) + COALESCE(length(meta), 0)),"
                                " 0) AS bytes FROM messages WHERE conversation_id = ? AND position >= ?",
                                (conv_id, start)).fetchone()["bytes"])

    @staticmethod
    def _set_usage(conn: Connection, owner: str, used: int) -> None:
        conn.execute("UPDATE owner_usage SET bytes = ? WHERE owner = ?", (max(0, used), owner))

    # ---- public API ---------------------------------------------------------------------

    def usage_bytes(self, owner: str) -> int:
        with self.db.connection() as conn:
            row = conn.execute("SELECT bytes FROM owner_usage WHERE owner = ?", (owner,)).fetchone()
        return int(row["bytes"]) if row else 0

    def list(self, owner: str) -> list[dict]:
        with self.db.connection() as conn:
            rows = conn.execute("SELECT * FROM conversations WHERE owner = ? "
                                f"ORDER BY updated_at DESC, {self.db.insert_order} DESC", (owner,)).fetchall()
        return [self._conv_dict(r) for r in rows]

    def create(self, owner: str, title: str = "New chat", model: str | None = None,
               settings: dict | None = None) -> dict:
        title = self._title(title)
        if model is not None:
            self._model(model)
        settings_text = self._json_field(settings or {}, "settings", self.limits.max_settings_bytes)
        conv_id = "conv_" + secrets.token_hex(12)
        now = time.time()
        with self.db.transaction() as conn:
            self._lock_usage(conn, owner)   # holds the per-owner conversation cap
            count = conn.execute("SELECT COUNT(*) AS n FROM conversations WHERE owner = ?", (owner,)).fetchone()["n"]
            if count >= self.limits.max_conversations_per_owner:
                raise InvalidRequest(f"You have {count} conversations, the maximum; delete some first.",
                                     param="conversation_id")
            conn.execute("INSERT INTO conversations (id, owner, title, model, settings, created_at, updated_at) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)", (conv_id, owner, title, model, settings_text, now, now))
            row = self._owned(conn, owner, conv_id)
        return self._conv_dict(row)

    def get(self, owner: str, conv_id: str) -> dict:
        with self.db.connection() as conn:
            conv = self._owned(conn, owner, conv_id)
            msgs = conn.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY position",
                                (conv_id,)).fetchall()
        return {**self._conv_dict(conv), "messages": [self._msg_dict(m) for m in msgs]}

    def update(self, owner: str, conv_id: str, *, title: object = None, model: object = None,
               settings: object = None) -> dict:
        sets: list[str] = []
        args: list[object] = []
        if title is not None:
            sets.append("title = ?")
            args.append(self._title(title))
        if model is not None:
            self._model(model)
            sets.append("model = ?")
            args.append(model)
        if settings is not None:
            sets.append("settings = ?")
            args.append(self._json_field(settings, "settings", self.limits.max_settings_bytes))
        with self.db.transaction() as conn:
            self._owned(conn, owner, conv_id, lock=True)
            if sets:
                conn.execute(f"UPDATE conversations SET {', '.join(sets)}, updated_at = ? "
                             "WHERE id = ? AND owner = ?", (*args, time.time(), conv_id, owner))
            row = self._owned(conn, owner, conv_id)
        return self._conv_dict(row)

    def delete(self, owner: str, conv_id: str) -> None:
        with self.db.transaction() as conn:
            self._owned(conn, owner, conv_id, lock=True)
            used = self._lock_usage(conn, owner)
            freed = self._bytes_from(conn, conv_id)
            conn.execute("DELETE FROM conversations WHERE id = ? AND owner = ?", (conv_id, owner))
            self._set_usage(conn, owner, used - freed)

    def put_messages(self, owner: str, conv_id: str, messages: object, *, start: int | None = None) -> dict:
        """Write `messages` at positions start, start+1, ...; every message at or after `start`
        is replaced. start=None appends after the last message; start=0 replaces them all
        (Regenerate sends the index of the answer it replaces). Returns what was written (ids and
        positions), never the whole conversation: an append costs the same however long it is."""
        if not isinstance(messages, list):
            raise InvalidRequest("'messages' must be a list of {role, content} objects.", param="messages")
        if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 0):
            raise InvalidRequest("'start' must be a non-negative integer.", param="start")
        rows = [self._message_row(m, i) for i, m in enumerate(messages)]
        now = time.time()
        with self.db.transaction() as conn:
            self._owned(conn, owner, conv_id, lock=True)
            used = self._lock_usage(conn, owner)
            count = conn.execute("SELECT COUNT(*) AS n FROM messages WHERE conversation_id = ?",
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
            freed = self._bytes_from(conn, conv_id, start)
            if added > freed and used - freed + added > self.limits.max_owner_bytes:
                raise QuotaExceeded(f"Your saved conversations would take {used - freed + added} bytes; the "
                                    f"quota is {self.limits.max_owner_bytes}. Delete old conversations first.",
                                    param="messages")
            conn.execute("DELETE FROM messages WHERE conversation_id = ? AND position >= ?", (conv_id, start))
            ids = [conn.insert_id("INSERT INTO messages (conversation_id, position, role, content, trace, meta,"
                                  " created_at) VALUES (?, ?, ?, ?, ?, ?, ?)", (conv_id, start + i, *row, now))
                   for i, row in enumerate(rows)]
            conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conv_id))
            self._set_usage(conn, owner, used + added - freed)
        return {"id": conv_id, "object": "kvserve.conversation.messages", "start": start,
                "total": start + len(rows),
                "messages": [{"id": mid, "position": start + i, "role": row[0], "created_at": now}
                             for i, (mid, row) in enumerate(zip(ids, rows))]}
