"""Moderation policies per key or tier in PostgreSQL: moderation_policy.PolicyStore's API, so every
server sharing the database applies the policies set with `kvserve keys moderation --database-url`.

The request path (on the event loop) reads policies from an in-memory copy and never waits for
the database: when the copy is older than `refresh_s` (1 s), a request starts one background
SELECT that replaces it, so a change made elsewhere applies within about a second. A change made
through this store is read back at once (the CLI shows it). If the database is unreachable, the
last copy stays in use (moderation keeps applying the policies it last saw) and the refresh is
retried `refresh_s` later.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from kvserve.server.backends.postgres import Database, PostgresStore, pg_errors
from kvserve.server.moderation_policy import validate

COMPONENT = "moderation_policies"
MIGRATIONS: list[tuple[str, ...]] = [
    (  # 1: moderation_policy.SCHEMA
        """CREATE TABLE moderation_policies (
            subject     TEXT PRIMARY KEY,
            policy      TEXT NOT NULL,
            updated_at  DOUBLE PRECISION NOT NULL)""",
    ),
]
logger = logging.getLogger("kvserve.server")


class PostgresPolicyStore(PostgresStore):
    component, migrations = COMPONENT, MIGRATIONS

    def __init__(self, url: str, *, db: Database | None = None, refresh_s: float = 1.0):
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._cache: dict[str, dict[str, Any]] = {}
        self._loaded_at: float | None = None
        self._refreshing = False
        super().__init__(url, db=db)

    @pg_errors
    def set(self, subject: str, policy: dict[str, Any]) -> None:
        validate(policy)
        with self.db.connection() as conn:
            conn.execute("INSERT INTO moderation_policies (subject, policy, updated_at) VALUES (%s, %s, %s) "
                         "ON CONFLICT (subject) DO UPDATE SET policy = excluded.policy, "
                         "updated_at = excluded.updated_at", (subject, json.dumps(policy), time.time()))
        self._loaded_at = None

    @pg_errors
    def delete(self, subject: str) -> bool:
        with self.db.connection() as conn:
            cur = conn.execute("DELETE FROM moderation_policies WHERE subject = %s", (subject,))
        self._loaded_at = None
        return cur.rowcount > 0

    def _read(self) -> dict[str, dict[str, Any]]:
        with self.db.connection() as conn:
            rows = conn.execute("SELECT subject, policy FROM moderation_policies").fetchall()
        return {r["subject"]: json.loads(r["policy"]) for r in rows}

    def _refresh(self) -> None:
        try:
            self._cache = self._read()
        except Exception:   # keep the last copy (see the module's docstring)
            logger.warning("reading moderation policies from PostgreSQL failed; using the last copy", exc_info=True)
        finally:
            self._loaded_at = time.monotonic()
            self._refreshing = False

    @pg_errors
    def all(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            if self._loaded_at is None:   # first use, or a change through this store: read it now
                self._cache = self._read()
                self._loaded_at = time.monotonic()
            elif time.monotonic() - self._loaded_at >= self.refresh_s and not self._refreshing:
                self._refreshing = True
                threading.Thread(target=self._refresh, name="kvserve-policy-refresh", daemon=True).start()
            return dict(self._cache)

    def for_caller(self, key_name: str | None, tier: str | None) -> list[dict[str, Any]]:
        """The policies that apply, weakest first: the tier's, then the key's."""
        policies = self.all()
        return [p for p in (policies.get(f"tier:{tier}") if tier else None,
                            policies.get(key_name) if key_name else None) if p]
