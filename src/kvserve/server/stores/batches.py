"""Batches (`/v1/batches`, OpenAI's Batch API): the batch, and one row per line of its input file
with the line's progress, in the server's SQLite file or in PostgreSQL.

A line is answered exactly once: a runner claims pending lines (`claim`: its name and a time;
a claim older than `stale_s` is free again, so a server that died leaves its lines to the next),
and `finish_line` writes the line's result and marks it done in one UPDATE that only succeeds
while the line is still pending and claimed by that runner. So a restart (or a second replica on
the same PostgreSQL) resumes with the lines not done, and a result is never written twice.

The statuses are OpenAI's: validating (the runner reads and checks the input file) →
in_progress → finalizing (output and error files written) → completed; or failed (the input
file is invalid), cancelling → cancelled, expired (past `expires_at`, completion_window after
creation). `request_counts` are counted from the lines. An owner sees only its own batches.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from typing import Any

from kvserve.errors import InvalidRequest, KVServeError, RetryLater
from kvserve.server.stores.quota import DEFAULT_QUOTAS, QuotaExceeded, QuotaLimits
from kvserve.server.stores.sql import Database, SQLStore, Steps

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "cancelled", "expired")


class BatchNotFound(KVServeError, status=404, code="not_found"):
    """No batch with this id for this caller (HTTP 404)."""


class TooManyBatches(RetryLater, status=429, type="rate_limit_error", code="too_many_active_batches"):
    """The owner already runs its cap of batches (HTTP 429, x-ratelimit-*-batches)."""

    def __init__(self, message: str, *, headers: dict[str, str], **kw):
        super().__init__(message, **kw)
        self.headers = headers


STEPS: Steps = [
    (  # 1
        """CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at $time NOT NULL,
    expires_at $time NOT NULL,
    in_progress_at $time,
    finalizing_at $time,
    completed_at $time,
    failed_at $time,
    expired_at $time,
    cancelling_at $time,
    cancelled_at $time,
    output_file_id TEXT,
    error_file_id TEXT,
    errors TEXT,
    metadata TEXT
)""",
        "CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner, created_at)",
        "CREATE INDEX IF NOT EXISTS batches_status ON batches (status)",
        """CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL REFERENCES batches (id) ON DELETE CASCADE,
    line $bigint NOT NULL,
    custom_id TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL,
    result TEXT,
    claimed_by TEXT,
    claimed_at $time,
    PRIMARY KEY (batch_id, line)
)""",
        "CREATE INDEX IF NOT EXISTS batch_lines_state ON batch_lines (batch_id, state, line)",
    ),
]

_TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
          "cancelled_at")


def _int(v: float | None) -> int | None:
    return int(v) if v is not None else None


class BatchStore(SQLStore):
    """Batches and their lines. `limits` (`--quota batches:items=N,ttl=D,active=N,lines=N`):
    batches an owner keeps (413 past it), how long a finished batch is kept (purged after),
    batches running at once (429 with `x-ratelimit-*-batches`) and lines not yet answered, in count
    and in bytes (a batch past either fails validation with `lines_quota_exceeded`). A line's body
    is dropped once it is answered, and its result once the batch's files are written."""

    component, steps = "batches", STEPS

    def __init__(self, db: Database | str | Any, limits: QuotaLimits | None = None):
        super().__init__(db)
        self.limits = limits or DEFAULT_QUOTAS["batches"]

    # ---- the API's calls (per owner) ----------------------------------------------------------

    def _admit(self, conn: Any, owner: str, now: float) -> None:
        """In create's transaction: the owner locked, their expired finished batches purged, and
        the caps on batches kept and running checked."""
        lim = self.limits
        self.db.lock_owner(conn, "batches", owner)
        if lim.ttl_s is not None:
            self._purge(conn, now - lim.ttl_s, owner)
        row = conn.execute("SELECT COUNT(*) AS n, COALESCE(SUM(CASE WHEN status IN ('validating', 'in_progress', "
                           "'finalizing', 'cancelling') THEN 1 ELSE 0 END), 0) AS active FROM batches WHERE owner = ?",
                           (owner,)).fetchone()
        if lim.max_items is not None and int(row["n"]) + 1 > lim.max_items:
            raise QuotaExceeded(f"This key keeps {row['n']} batches, the maximum; finished batches are purged "
                                f"{(lim.ttl_s or 0) / 86400:g} days after they end.", param="input_file_id")
        if lim.max_active is not None and int(row["active"]) + 1 > lim.max_active:
            raise TooManyBatches(f"This key already runs {row['active']} batches (at most {lim.max_active} at "
                                 "once); wait for one to finish or cancel one.", retry_after=60.0,
                                 headers={"x-ratelimit-limit-batches": str(lim.max_active),
                                          "x-ratelimit-remaining-batches": "0"})

    def _purge(self, conn: Any, before: float, owner: str | None = None) -> int:
        """Finished batches that ended before `before` deleted (their lines with them: ON DELETE CASCADE)."""
        ended = "COALESCE(completed_at, failed_at, cancelled_at, expired_at, created_at)"
        sql = f"DELETE FROM batches WHERE status IN ('completed', 'failed', 'cancelled', 'expired') AND {ended} < ?"
        args: list[Any] = [before]
        if owner is not None:
            sql, args = sql + " AND owner = ?", [*args, owner]
        return conn.execute(sql, args).rowcount

    def purge(self, now: float | None = None) -> int:
        """Every owner's finished batches past the keep time deleted; how many."""
        if self.limits.ttl_s is None:
            return 0
        with self.db.transaction() as conn:
            return self._purge(conn, (time.time() if now is None else now) - self.limits.ttl_s)

    def create(self, owner: str, endpoint: str, input_file_id: str, completion_window: str, window_s: float,
               metadata: dict[str, str] | None) -> dict[str, Any]:
        now = time.time()
        batch_id = f"batch_{uuid.uuid4().hex}"
        with self.db.transaction() as conn:
            self._admit(conn, owner, now)
            conn.execute("INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, "
                         "created_at, expires_at, metadata) VALUES (?, ?, ?, ?, ?, 'validating', ?, ?, ?)",
                         (batch_id, owner, endpoint, input_file_id, completion_window, now, now + window_s,
                          json.dumps(metadata) if metadata is not None else None))
        return self.get(owner, batch_id)

    def _owned(self, owner: str, batch_id: str) -> dict[str, Any]:
        with self.db.connection() as conn:
            row = conn.execute("SELECT * FROM batches WHERE id = ? AND owner = ?", (batch_id, owner)).fetchone()
        if row is None:
            raise BatchNotFound(f"No batch with id {batch_id!r} (batches are visible only to the key that "
                                "created them).", param="batch_id")
        return row

    def get(self, owner: str, batch_id: str) -> dict[str, Any]:
        return self._object(self._owned(owner, batch_id))

    def list(self, owner: str, limit: int = 20, after: str | None = None) -> list[dict[str, Any]]:
        sql, args = "SELECT * FROM batches WHERE owner = ?", [owner]
        if after:
            sql += " AND created_at < (SELECT created_at FROM batches WHERE id = ? AND owner = ?)"
            args += [after, owner]
        with self.db.connection() as conn:
            rows = conn.execute(sql + " ORDER BY created_at DESC LIMIT ?", (*args, limit)).fetchall()
        return [self._object(r) for r in rows]

    def cancel(self, owner: str, batch_id: str) -> dict[str, Any]:
        """validating / in_progress → cancelling (the runner stops the batch's lines and writes what
        is done); a batch already cancelling or cancelled is returned as it is."""
        row = self._owned(owner, batch_id)
        if row["status"] in ("validating", "in_progress"):
            with self.db.connection() as conn:
                conn.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? "
                             "AND status IN ('validating', 'in_progress')", (time.time(), batch_id))
        elif row["status"] not in ("cancelling", "cancelled"):
            raise InvalidRequest(f"Batch {batch_id!r} is {row['status']} and cannot be cancelled.",
                                 param="batch_id", code="batch_not_cancellable")
        return self.get(owner, batch_id)

    def counts(self, batch_id: str) -> dict[str, int]:
        with self.db.connection() as conn:
            rows = conn.execute("SELECT state, COUNT(*) AS n FROM batch_lines WHERE batch_id = ? GROUP BY state",
                                (batch_id,)).fetchall()
        by = {r["state"]: int(r["n"]) for r in rows}
        return {"total": sum(by.values()), "completed": by.get("done", 0), "failed": by.get("failed", 0)}

    def _object(self, row: dict[str, Any]) -> dict[str, Any]:
        """A row in OpenAI's `batch` shape."""
        errors = json.loads(row["errors"]) if row["errors"] else None
        out = {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
               "errors": {"object": "list", "data": errors} if errors else None,
               "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
               "status": row["status"], "output_file_id": row["output_file_id"],
               "error_file_id": row["error_file_id"], "created_at": int(row["created_at"]),
               "expires_at": int(row["expires_at"])}
        out.update({k: _int(row[k]) for k in _TIMES})
        out["request_counts"] = self.counts(row["id"])
        out["metadata"] = json.loads(row["metadata"]) if row["metadata"] else None
        return out

    # ---- the runner's calls (api/batch_runner.py) -----------------------------------------

    def active(self) -> list[dict[str, Any]]:
        """The batches a runner has work on, oldest first (raw rows)."""
        with self.db.connection() as conn:
            return conn.execute("SELECT * FROM batches WHERE status IN ('validating', 'in_progress', 'finalizing', "
                                "'cancelling') ORDER BY created_at").fetchall()

    def stored_lines(self) -> int:
        """Batch lines stored, all batches (the /metrics gauge)."""
        with self.db.connection() as conn:
            return int(conn.execute("SELECT COUNT(*) AS n FROM batch_lines").fetchone()["n"])

    def row(self, batch_id: str) -> dict[str, Any] | None:
        with self.db.connection() as conn:
            return conn.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()

    def start(self, batch_id: str, lines: Iterable[tuple[str, str]]) -> bool:
        """The checked lines (custom_id, body JSON; an iterable, consumed once, never listed) stored
        and the batch in_progress, in one transaction; False when the batch is no longer validating
        (cancelled meanwhile). An error the iterable raises, or the owner's lines past the `lines`
        quota, rolls everything back (QuotaExceeded for the quota)."""
        with self.db.transaction() as conn:
            row = conn.execute("SELECT status, owner FROM batches WHERE id = ?" + self.db.for_update,
                               (batch_id,)).fetchone()
            if row is None or row["status"] != "validating":
                return False
            conn.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
            n = size = 0
            for n, (custom_id, body) in enumerate(lines, start=1):
                size += len(body.encode())
                conn.execute("INSERT INTO batch_lines (batch_id, line, custom_id, body, state) "
                             "VALUES (?, ?, ?, ?, 'pending')", (batch_id, n - 1, custom_id, body))
            lim = self.limits
            if lim.max_lines is not None or lim.max_bytes is not None:
                busy = conn.execute(f"SELECT COUNT(*) AS n, COALESCE(SUM({self.db.octets('l.body')}), 0) AS b "
                                    "FROM batch_lines l JOIN batches b ON b.id = l.batch_id WHERE b.owner = ? "
                                    "AND b.id <> ? AND l.state = 'pending'", (row["owner"], batch_id)).fetchone()
                if lim.max_lines is not None and int(busy["n"]) + n > lim.max_lines:
                    raise QuotaExceeded(f"This batch's {n} requests and the {busy['n']} this key's other batches "
                                        f"have not run yet pass its quota of {lim.max_lines} requests waiting; "
                                        "create it again when those are done.", code="lines_quota_exceeded")
                if lim.max_bytes is not None and int(busy["b"]) + size > lim.max_bytes:
                    raise QuotaExceeded(f"This batch's requests ({size} bytes) and those this key's other batches "
                                        f"have not run yet ({busy['b']} bytes) pass its quota of {lim.max_bytes} "
                                        "bytes waiting; create it again when those are done.",
                                        code="lines_quota_exceeded")
            conn.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ? WHERE id = ?",
                         (time.time(), batch_id))
        return True

    def set_status(self, batch_id: str, status: str, *, when: tuple[str, ...] = ACTIVE, **fields: Any) -> bool:
        """Move the batch to `status` (stamping `<status>_at`) if it is in one of `when`. A final
        status drops what the lines still hold (their bodies and results: the output and error
        files have them now), keeping each line's state for `request_counts`."""
        sets = {f"{status}_at": time.time(), **fields}
        cols = ", ".join(f"{k} = ?" for k in sets)
        marks = ", ".join("?" for _ in when)
        with self.db.transaction() as conn:
            cur = conn.execute(f"UPDATE batches SET status = ?, {cols} WHERE id = ? AND status IN ({marks})",
                               (status, *sets.values(), batch_id, *when))
            if cur.rowcount > 0 and status in FINAL:
                conn.execute("UPDATE batch_lines SET body = '', result = NULL WHERE batch_id = ?", (batch_id,))
        return cur.rowcount > 0

    def fail(self, batch_id: str, errors: list[dict[str, Any]]) -> bool:
        return self.set_status(batch_id, "failed", when=("validating",), errors=json.dumps(errors))

    def claim(self, batch_id: str, runner: str, n: int = 1, stale_s: float = 60.0) -> list[dict[str, Any]]:
        """Up to `n` pending lines no live runner holds, now held by `runner` (line, custom_id, body)."""
        now = time.time()
        with self.db.transaction() as conn:
            rows = conn.execute("SELECT line, custom_id, body FROM batch_lines WHERE batch_id = ? AND state = "
                                "'pending' AND (claimed_by IS NULL OR claimed_at < ?) ORDER BY line LIMIT ?"
                                + self.db.for_update, (batch_id, now - stale_s, n)).fetchall()
            for r in rows:
                conn.execute("UPDATE batch_lines SET claimed_by = ?, claimed_at = ? WHERE batch_id = ? AND line = ?",
                             (runner, now, batch_id, r["line"]))
        return rows

    def heartbeat(self, runner: str, lines: list[tuple[str, int]]) -> None:
        """Keep the runner's claims on the lines it is running fresh."""
        now = time.time()
        with self.db.transaction() as conn:
            for batch_id, line in lines:
                conn.execute("UPDATE batch_lines SET claimed_at = ? WHERE batch_id = ? AND line = ? AND claimed_by = ?",
                             (now, batch_id, line, runner))

    def release(self, runner: str, batch_id: str | None = None, line: int | None = None) -> None:
        """Give back the runner's unanswered lines (all, a batch's, or one line)."""
        sql = "UPDATE batch_lines SET claimed_by = NULL, claimed_at = NULL WHERE claimed_by = ? AND state = 'pending'"
        args: list = [runner]
        if batch_id is not None:
            sql, args = sql + " AND batch_id = ?", [*args, batch_id]
        if line is not None:
            sql, args = sql + " AND line = ?", [*args, line]
        with self.db.connection() as conn:
            conn.execute(sql, args)

    def finish_line(self, batch_id: str, line: int, runner: str, ok: bool, result: dict[str, Any]) -> bool:
        """The line's result written and the line marked done (or failed), atomically, if it is
        still pending and held by `runner`; False when it is not (someone else answered it)."""
        with self.db.connection() as conn:
            cur = conn.execute("UPDATE batch_lines SET state = ?, result = ?, body = '', claimed_by = NULL "
                               "WHERE batch_id = ? "
                               "AND line = ? AND state = 'pending' AND claimed_by = ?",
                               ("done" if ok else "failed", json.dumps(result), batch_id, line, runner))
        return cur.rowcount > 0

    def fail_pending(self, batch_id: str, result_for: Any) -> None:
        """Every pending line failed with `result_for(custom_id)` (an expired batch)."""
        with self.db.transaction() as conn:
            rows = conn.execute("SELECT line, custom_id FROM batch_lines WHERE batch_id = ? AND state = 'pending'",
                                (batch_id,)).fetchall()
            for r in rows:
                conn.execute("UPDATE batch_lines SET state = 'failed', result = ?, body = '', claimed_by = NULL "
                             "WHERE batch_id = ? AND line = ?", (json.dumps(result_for(r["custom_id"])), batch_id,
                                                                 r["line"]))

    def pending(self, batch_id: str) -> int:
        with self.db.connection() as conn:
            return int(conn.execute("SELECT COUNT(*) AS n FROM batch_lines WHERE batch_id = ? AND state = 'pending'",
                                    (batch_id,)).fetchone()["n"])

    def results(self, batch_id: str, state: str) -> str:
        """The JSONL of the lines in `state` ("done": the output file, "failed": the error file)."""
        with self.db.connection() as conn:
            rows = conn.execute("SELECT result FROM batch_lines WHERE batch_id = ? AND state = ? ORDER BY line",
                                (batch_id, state)).fetchall()
        return "".join(r["result"] + "\n" for r in rows)
