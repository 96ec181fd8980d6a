"""Saved chat conversations for the web page: a small SQLite store (WAL mode).

Layout (one file, two tables):

    conversations(id, owner, title, model, settings JSON, created_at, updated_at)
    messages(id, conversation_id → conversations.id ON DELETE CASCADE, position, role,
             content, trace JSON | NULL, meta JSON | NULL, created_at)

Every read and write is scoped by `owner`, a string the web layer derives from the caller:
`key:<api key name>` when the server runs with auth, `client:<browser id>` when it does not.
A conversation that belongs to another owner is indistinguishable from one that does not
exist (both raise ConversationNotFound), so ids leak nothing across owners.

Each owner has a storage quota (`StoreLimits.max_owner_bytes`, the bytes of their messages'
content, traces and meta, kept in `owner_usage` by every write and delete): past it, 413
`storage_quota_exceeded`, which says to delete old conversations.
"""

from __future__ import annotations

import json
import pathlib
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass

from kvserve.errors import InvalidRequest, KVServeError
from kvserve.server import storage

ROLES = ("system", "user", "assistant", "tool")   # "tool": a tool call's result (meta.tool_call_id)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id          TEXT PRIMARY KEY,
    owner       TEXT NOT NULL,
    title       TEXT NOT NULL,
    model       TEXT,
    settings    TEXT NOT NULL DEFAULT '{}',
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS owner_usage (
    owner TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS conversations_owner ON conversations(owner, updated_at DESC);
CREATE TABLE IF NOT EXISTS messages (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    position        INTEGER NOT NULL,
    role            TEXT NOT NULL,
    content         TEXT NOT NULL,
    trace           TEXT,
    meta            TEXT,
    created_at      REAL NOT NULL,
    UNIQUE (conversation_id, position)
);
"""


class QuotaExceeded(KVServeError):
    """An owner's conversations would exceed their storage quota (HTTP 413)."""

    status = 413
    code = "storage_quota_exceeded"


class ConversationNotFound(KVServeError):
    """No conversation with this id for this caller (HTTP 404)."""

    status = 404
    code = "conversation_not_found"


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


class ConversationStore:
    """Thread-safe SQLite store; one connection guarded by a lock (FastAPI runs sync routes
    in a thread pool, and SQLite writes are serialised anyway)."""

    def __init__(self, db_path: pathlib.Path | str, limits: StoreLimits | None = None):
        self.db_path = pathlib.Path(db_path)
        self.limits = limits or StoreLimits()
        self._lock = threading.Lock()
        self._conn = storage.connect(self.db_path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._conn.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # ---- validation helpers -------------------------------------------------------------

    def _title(self, title: object) -> str:
        if not isinstance(title, str):
            raise InvalidRequest("'title' must be a string.", param="title")
        title = " ".join(title.split())
        if len(title) > self.limits.max_title_chars:
            raise InvalidRequest(f"'title' is longer than {self.limits.max_title_chars} characters; "
                                 "shorten it.", param="title")
        return title or "New chat"

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
        trace = self._json_field(msg.get("trace"), f"messages[{i}].trace", self.limits.max_trace_bytes)
        meta = self._json_field(msg.get("meta"), f"messages[{i}].meta", self.limits.max_meta_bytes)
        return role, content, trace, meta

    @staticmethod
    def _conv_dict(row: sqlite3.Row) -> dict:
        return {"id": row["id"], "object": "kvserve.conversation", "title": row["title"],
                "model": row["model"], "settings": json.loads(row["settings"]),
                "created_at": row["created_at"], "updated_at": row["updated_at"]}

    @staticmethod
    def _msg_dict(row: sqlite3.Row) -> dict:
        return {"id": row["id"], "position": row["position"], "role": row["role"],
                "content": row["content"],
                "trace": json.loads(row["trace"]) if row["trace"] else None,
                "meta": json.loads(row["meta"]) if row["meta"] else None,
                "created_at": row["created_at"]}

    def _owned(self, owner: str, conv_id: str) -> sqlite3.Row:
        row = self._conn.execute("SELECT * FROM conversations WHERE id = ? AND owner = ?",
                                 (conv_id, owner)).fetchone()
        if row is None:
            raise ConversationNotFound(f"No conversation '{conv_id}'; list yours with "
                                       "GET /v1/kvserve/conversations.", param="conversation_id")
        return row

    # ---- public API ---------------------------------------------------------------------

    def list(self, owner: str) -> list[dict]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT * FROM conversations WHERE owner = ? ORDER BY updated_at DESC, rowid DESC",
                (owner,)).fetchall()
        return [self._conv_dict(r) for r in rows]

    def create(self, owner: str, title: str = "New chat", model: str | None = None,
               settings: dict | None = None) -> dict:
        title = self._title(title)
        if model is not None and not isinstance(model, str):
            raise InvalidRequest("'model' must be a string.", param="model")
        settings_text = self._json_field(settings or {}, "settings", self.limits.max_settings_bytes)
        conv_id = "conv_" + secrets.token_hex(12)
        now = time.time()
        with self._lock:
            (count,) = self._conn.execute("SELECT COUNT(*) FROM conversations WHERE owner = ?",
                                          (owner,)).fetchone()
            if count >= self.limits.max_conversations_per_owner:
                raise InvalidRequest(f"You have {count} conversations, the maximum; delete some first.",
                                     param="conversation_id")
            self._conn.execute(
                "INSERT INTO conversations (id, owner, title, model, settings, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)", (conv_id, owner, title, model, settings_text, now, now))
            row = self._owned(owner, conv_id)
        return self._conv_dict(row)

    def get(self, owner: str, conv_id: str) -> dict:
        with self._lock:
            conv = self._owned(owner, conv_id)
            msgs = self._conn.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY position",
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
            if not isinstance(model, str):
                raise InvalidRequest("'model' must be a string.", param="model")
            sets.append("model = ?")
            args.append(model)
        if settings is not None:
            sets.append("settings = ?")
            args.append(self._json_field(settings, "settings", self.limits.max_settings_bytes))
        with self._lock:
            self._owned(owner, conv_id)
            if sets:
                self._conn.execute(f"UPDATE conversations SET {', '.join(sets)}, updated_at = ? "
                                   "WHERE id = ? AND owner = ?", (*args, time.time(), conv_id, owner))
            row = self._owned(owner, conv_id)
        return self._conv_dict(row)

    _ROW_BYTES = "COALESCE(SUM(length(CAST(content AS BLOB)) + COALESCE(length(trace), 0) + COALESCE(length(meta), 0)), 0)"

    def _add_usage(self, owner: str, delta: int) -> None:
        self._conn.execute("INSERT INTO owner_usage (owner, bytes) VALUES (?, ?) ON CONFLICT(owner) "
                           "DO UPDATE SET bytes = max(0, bytes + excluded.bytes)", (owner, delta))

    def usage_bytes(self, owner: str) -> int:
        row = self._conn.execute("SELECT bytes FROM owner_usage WHERE owner = ?", (owner,)).fetchone()
        return row[0] if row else 0

    def delete(self, owner: str, conv_id: str) -> None:
        with self._lock:
            self._owned(owner, conv_id)
            (freed,) = self._conn.execute(f"SELECT {self._ROW_BYTES} FROM messages WHERE conversation_id = ?",
                                          (conv_id,)).fetchone()
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute("DELETE FROM conversations WHERE id = ? AND owner = ?", (conv_id, owner))
                self._add_usage(owner, -freed)
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

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
        with self._lock:
            self._owned(owner, conv_id)
            (count,) = self._conn.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?",
                                          (conv_id,)).fetchone()
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
            (freed,) = self._conn.execute(f"SELECT {self._ROW_BYTES} FROM messages WHERE conversation_id = ? "
                                          "AND position >= ?", (conv_id, start)).fetchone()
            used = self.usage_bytes(owner)
            if added > freed and used - freed + added > self.limits.max_owner_bytes:
                raise QuotaExceeded(f"Your saved conversations would take {used - freed + added} bytes; the "
                                    f"quota is {self.limits.max_owner_bytes}. Delete old conversations first.",
                                    param="messages")
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute("DELETE FROM messages WHERE conversation_id = ? AND position >= ?",
                                   (conv_id, start))
                ids = [self._conn.execute(
                    "INSERT INTO messages (conversation_id, position, role, content, trace, meta, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)", (conv_id, start + i, *row, now)).lastrowid
                    for i, row in enumerate(rows)]
                self._conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conv_id))
                self._add_usage(owner, added - freed)
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return {"id": conv_id, "object": "kvserve.conversation.messages", "start": start,
                "total": start + len(rows),
                "messages": [{"id": mid, "position": start + i, "role": row[0], "created_at": now}
                             for i, (mid, row) in enumerate(zip(ids, rows))]}
