"""Uploaded and generated files (`/v1/files`, OpenAI's Files API), per owner, in the server's
SQLite file or in PostgreSQL with --database-url (so a file uploaded through one server is read,
used by a batch or deleted through another).

A file is its metadata row plus its content, JSONL text kept in the same row (TEXT: every byte
an upload may hold is UTF-8 and checked before it is stored, and both databases keep it with the
metadata in one write). An owner sees only its own files: another owner's id is a 404, as is an
unknown one. Two limits guard the store: `max_file_bytes` per upload (413 `file_too_large`) and
a per-owner quota, `max_owner_files` files and `max_owner_bytes` bytes (413
`storage_quota_exceeded`; delete old files). Files the server writes itself (a batch's output
and error files, `put(..., quota=False)`) count toward the quota but are never refused: a batch
must not lose its answers because its owner's store is full.

The quota check is `_check_quota`, the one place that reads an owner's usage; it is written so
that it can move onto a shared per-owner quota mechanism when the stores get one.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvserve.errors import InvalidRequest, KVServeError
from kvserve.server.stores.sql import Connection, SQLStore, Steps

PURPOSES = ("batch", "batch_output", "user_data", "fine-tune", "assistants", "vision", "evals")
UPLOAD_PURPOSES = ("batch", "user_data")


class FileNotFound(KVServeError, status=404, code="not_found"):
    """No file with this id for this caller (HTTP 404)."""


class FileTooLarge(InvalidRequest, status=413, code="file_too_large"):
    """An upload larger than the server's per-file cap (HTTP 413)."""


class FileQuotaExceeded(KVServeError, status=413, code="storage_quota_exceeded"):
    """The owner's files would exceed their count or byte quota (HTTP 413)."""


@dataclass
class FileLimits:
    max_file_bytes: int = 64 << 20        # one upload
    max_owner_files: int = 500            # files an owner may hold
    max_owner_bytes: int = 1 << 30        # the bytes of all of an owner's files


STEPS: Steps = [
    (  # 1
        """CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes $bigint NOT NULL,
    created_at $time NOT NULL,
    content TEXT NOT NULL
)""",
        "CREATE INDEX IF NOT EXISTS files_owner ON files (owner, created_at)",
        # one row per owner, locked while an upload checks the quota (PostgreSQL: FOR UPDATE)
        "CREATE TABLE IF NOT EXISTS file_owners (owner TEXT PRIMARY KEY)",
    ),
]

_META = "id, owner, purpose, filename, bytes, created_at"


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    """A row in OpenAI's `file` shape."""
    return {"id": row["id"], "object": "file", "bytes": int(row["bytes"]), "created_at": int(row["created_at"]),
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None, "expires_at": None}


class FileStore(SQLStore):
    component, steps = "files", STEPS

    def __init__(self, db, limits: FileLimits | None = None):
        super().__init__(db)
        self.limits = limits or FileLimits()

    def _check_quota(self, conn: Connection, owner: str, size: int) -> None:
        row = conn.execute("SELECT COUNT(*) AS n, COALESCE(SUM(bytes), 0) AS b FROM files WHERE owner = ?",
                           (owner,)).fetchone()
        n, used = int(row["n"]), int(row["b"])
        if n + 1 > self.limits.max_owner_files:
            raise FileQuotaExceeded(f"This key already holds {n} files (at most {self.limits.max_owner_files}); "
                                    "delete old ones with DELETE /v1/files/{file_id}.", param="file")
        if used + size > self.limits.max_owner_bytes:
            raise FileQuotaExceeded(f"This key's files hold {used} bytes; {size} more would pass its quota of "
                                    f"{self.limits.max_owner_bytes} bytes. Delete old files first.", param="file")

    def check_size(self, size: int) -> None:
        if size > self.limits.max_file_bytes:
            raise FileTooLarge(f"The file is {size} bytes; this server accepts files of at most "
                               f"{self.limits.max_file_bytes} bytes. Split it into several files.", param="file")

    def put(self, owner: str, purpose: str, filename: str, content: str, *, file_id: str | None = None,
            quota: bool = True) -> dict[str, Any]:
        """Store a file; its `file` object. With `file_id` given and taken, the stored file is
        kept and returned (a generated file written again after a restart)."""
        size = len(content.encode())
        if quota:
            self.check_size(size)
        self.db.check_text(content, "file")
        row = {"id": file_id or f"file-{uuid.uuid4().hex}", "owner": owner, "purpose": purpose,
               "filename": filename, "bytes": size, "created_at": time.time()}
        with self.db.transaction() as conn:
            if quota:   # the count and the insert in one transaction: concurrent uploads cannot both pass
                conn.execute("INSERT INTO file_owners (owner) VALUES (?) ON CONFLICT (owner) DO NOTHING", (owner,))
                conn.execute("SELECT owner FROM file_owners WHERE owner = ?" + self.db.for_update, (owner,))
                self._check_quota(conn, owner, size)
            conn.execute(f"INSERT INTO files ({_META}, content) VALUES (?, ?, ?, ?, ?, ?, ?) "
                         "ON CONFLICT (id) DO NOTHING", (*row.values(), content))
        return self.get(owner, row["id"])

    def _row(self, owner: str, file_id: str, columns: str) -> dict[str, Any]:
        with self.db.connection() as conn:
            row = conn.execute(f"SELECT {columns} FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
        if row is None:
            raise FileNotFound(f"No file with id {file_id!r} (files are visible only to the key that uploaded "
                               "them).", param="file_id")
        return row

    def get(self, owner: str, file_id: str) -> dict[str, Any]:
        return file_object(self._row(owner, file_id, _META))

    def content(self, owner: str, file_id: str) -> str:
        return self._row(owner, file_id, "content")["content"]

    def list(self, owner: str, purpose: str | None = None, limit: int = 10_000, after: str | None = None,
             order: str = "desc") -> list[dict[str, Any]]:
        sql = f"SELECT {_META} FROM files WHERE owner = ?"
        args: list[Any] = [owner]
        if purpose:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        if after:
            cmp = "<" if order == "desc" else ">"
            sql += f" AND created_at {cmp} (SELECT created_at FROM files WHERE id = ? AND owner = ?)"
            args += [after, owner]
        sql += f" ORDER BY created_at {'DESC' if order == 'desc' else 'ASC'} LIMIT ?"
        with self.db.connection() as conn:
            rows = conn.execute(sql, (*args, limit)).fetchall()
        return [file_object(r) for r in rows]

    def delete(self, owner: str, file_id: str) -> None:
        with self.db.connection() as conn:
            cur = conn.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner))
        if cur.rowcount == 0:
            raise FileNotFound(f"No file with id {file_id!r}.", param="file_id")
