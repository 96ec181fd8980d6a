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
must not lose its answers because its owner's store is full; they expire after `OUTPUT_TTL_S`
(OpenAI's 30 days), an upload after its `expires_after`, and `purge` (the batch runner, every
few minutes) deletes expired files of every owner.

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
    (  # 2: when a file expires (a side table: SQLite files keep no schema version to ALTER by)
        "CREATE TABLE IF NOT EXISTS file_expiry (id TEXT PRIMARY KEY, expires_at $time NOT NULL)",
        "CREATE INDEX IF NOT EXISTS file_expiry_at ON file_expiry (expires_at)",
    ),
]
OUTPUT_TTL_S = 30 * 86400     # OpenAI: a batch's output and error files expire 30 days after they are written
_LIVE = " AND NOT EXISTS (SELECT 1 FROM file_expiry x WHERE x.id = files.id AND x.expires_at < ?)"

_META = "id, owner, purpose, filename, bytes, created_at"
_META_X = ("files.id, owner, purpose, filename, bytes, created_at, "
           "(SELECT expires_at FROM file_expiry x WHERE x.id = files.id) AS expires_at")


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    """A row in OpenAI's `file` shape."""
    expires = row.get("expires_at")
    return {"id": row["id"], "object": "file", "bytes": int(row["bytes"]), "created_at": int(row["created_at"]),
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None, "expires_at": int(expires) if expires is not None else None}


class FileStore(SQLStore):
    component, steps = "files", STEPS

    def __init__(self, db, limits: FileLimits | None = None):
        super().__init__(db)
        self.limits = limits or FileLimits()

    def _check_quota(self, conn: Connection, owner: str, size: int) -> None:
        conn.execute("DELETE FROM files WHERE owner = ? AND id IN (SELECT id FROM file_expiry WHERE expires_at < ?)",
                     (owner, time.time()))   # an owner's expired files never count against them
        row = conn.execute("SELECT COUNT(*) AS n, COALESCE(SUM(bytes), 0) AS b FROM files WHERE owner = ?",
                           (owner,)).fetchone()
        n, used = int(row["n"]), int(row["b"])
        if n + 1 > self.limits.max_owner_files:
            raise FileQuotaExceeded(f"This key already holds {n} files (at most {self.limits.max_owner_files}); "
                                    "delete old ones with DELETE /v1/files/{file_id}.", param="file")
        if used + size > self.limits.max_owner_bytes:
            raise FileQuotaExceeded(f"This key's files hold {used} bytes; {size} more would pass its quota of "
                                    f"{self.limits.max_owner_bytes} bytes. Delete old files first.", param="file")

    def size_error(self, size: int) -> FileTooLarge:
        return FileTooLarge(f"The file is {size} bytes or more; this server accepts files of at most "
                            f"{self.limits.max_file_bytes} bytes. Split it into several files.", param="file")

    def check_size(self, size: int) -> None:
        if size > self.limits.max_file_bytes:
            raise self.size_error(size)

    def put(self, owner: str, purpose: str, filename: str, content: str, *, file_id: str | None = None,
            quota: bool = True, expires_s: float | None = None) -> dict[str, Any]:
        """Store a file; its `file` object. With `file_id` given and taken, the stored file is
        kept and returned (a generated file written again after a restart). `expires_s`: the file
        is gone that long after now (a batch's output: `OUTPUT_TTL_S` unless given)."""
        if expires_s is None and purpose == "batch_output":
            expires_s = OUTPUT_TTL_S
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
            if expires_s is not None:
                conn.execute("INSERT INTO file_expiry (id, expires_at) VALUES (?, ?) ON CONFLICT (id) DO NOTHING",
                             (row["id"], row["created_at"] + expires_s))
        return self.get(owner, row["id"])

    def purge(self, now: float | None = None, limit: int = 500) -> int:
        """Delete up to `limit` expired files (any owner); how many went."""
        now = time.time() if now is None else now
        with self.db.transaction() as conn:
            ids = [r["id"] for r in conn.execute("SELECT id FROM file_expiry WHERE expires_at < ? LIMIT ?",
                                                 (now, limit)).fetchall()]
            for i in ids:
                conn.execute("DELETE FROM files WHERE id = ?", (i,))
                conn.execute("DELETE FROM file_expiry WHERE id = ?", (i,))
        return len(ids)

    def stored(self) -> tuple[int, int]:
        """(files, bytes) of every stored file (the /metrics gauges)."""
        with self.db.connection() as conn:
            row = conn.execute("SELECT COUNT(*) AS n, COALESCE(SUM(bytes), 0) AS b FROM files").fetchone()
        return int(row["n"]), int(row["b"])

    def _row(self, owner: str, file_id: str, columns: str) -> dict[str, Any]:
        with self.db.connection() as conn:
            row = conn.execute(f"SELECT {columns} FROM files WHERE id = ? AND owner = ?{_LIVE}",
                               (file_id, owner, time.time())).fetchone()
        if row is None:
            raise FileNotFound(f"No file with id {file_id!r} (files are visible only to the key that uploaded "
                               "them).", param="file_id")
        return row

    def get(self, owner: str, file_id: str) -> dict[str, Any]:
        return file_object(self._row(owner, file_id, _META_X))

    def content(self, owner: str, file_id: str) -> str:
        return self._row(owner, file_id, "content")["content"]

    def list(self, owner: str, purpose: str | None = None, limit: int = 10_000, after: str | None = None,
             order: str = "desc") -> list[dict[str, Any]]:
        sql = f"SELECT {_META_X} FROM files WHERE owner = ?{_LIVE}"
        args: list[Any] = [owner, time.time()]
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
            conn.execute("DELETE FROM file_expiry WHERE id = ?", (file_id,))
        if cur.rowcount == 0:
            raise FileNotFound(f"No file with id {file_id!r}.", param="file_id")
