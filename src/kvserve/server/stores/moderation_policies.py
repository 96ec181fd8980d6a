"""Moderation policies per key or tier, stored next to the keys (`kvserve keys moderation`).

A policy is a JSON object of `ModerationConfig` overrides (`mode`, `thresholds`, `blocklist`,
`regexes`, `pii_input`, `pii_output`, `jailbreak`, `check_every`, `action` block | annotate,
`request_overrides`: whether a request's `kvserve_moderation` may change them) stored under a subject: a key's
name, or `tier:free` / `tier:paid`. A request's config is the server's (`kvserve serve
--moderation ...`), then its tier's policy, then its key's.

The request path reads policies from an in-memory copy (`all`), refreshed as cheaply as the
database allows: from SQLite, re-read when `data_version` says another connection (the CLI)
changed the table; from PostgreSQL (--database-url, shared by every server), never waited for on
the event loop: when the copy is older than `refresh_s` (1 s), a request starts one background
SELECT that replaces it, so a change made elsewhere applies within about a second. A change made
through this store is read back at once (the CLI shows it). If the database cannot be read, the
last copy stays in use (moderation keeps applying the policies it last saw).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from kvserve.safety.policy import FIELDS, load_options, policy_from_options, validate
from kvserve.server.stores.sql import SQLStore, Steps

STEPS: Steps = [
    (  # 1
        """CREATE TABLE IF NOT EXISTS moderation_policies (
    subject TEXT PRIMARY KEY,
    policy TEXT NOT NULL,
    updated_at $time NOT NULL
)""",
    ),
]
logger = logging.getLogger("kvserve.server")


class PolicyStore(SQLStore):
    """Policies by subject on one database, read through an in-memory copy (see the module's docstring)."""

    component, steps = "moderation_policies", STEPS

    def __init__(self, db, *, refresh_s: float = 1.0):
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._cache: dict[str, dict[str, Any]] = {}
        self._version: int | None = None        # SQLite: the data_version the copy is of
        self._loaded_at: float | None = None    # PostgreSQL: when the copy was read
        self._refreshing = False
        super().__init__(db)

    def _changed(self) -> None:
        self._version = self._loaded_at = None   # read back at the next `all`

    def set(self, subject: str, policy: dict[str, Any]) -> None:
        validate(policy)
        with self.db.connection() as conn:
            conn.execute("INSERT INTO moderation_policies (subject, policy, updated_at) VALUES (?, ?, ?) "
                         "ON CONFLICT (subject) DO UPDATE SET policy = excluded.policy, "
                         "updated_at = excluded.updated_at", (subject, json.dumps(policy), time.time()))
        self._changed()

    def delete(self, subject: str) -> bool:
        with self.db.connection() as conn:
            cur = conn.execute("DELETE FROM moderation_policies WHERE subject = ?", (subject,))
        self._changed()
        return cur.rowcount > 0

    def _read(self) -> dict[str, dict[str, Any]]:
        with self.db.connection() as conn:
            rows = conn.execute("SELECT subject, policy FROM moderation_policies").fetchall()
        return {r["subject"]: json.loads(r["policy"]) for r in rows}

    def _refresh(self) -> None:
        try:
            self._cache = self._read()
        except Exception:   # keep the last copy (see the module's docstring)
            logger.warning("reading moderation policies failed; using the last copy", exc_info=True)
        finally:
            self._loaded_at = time.monotonic()
            self._refreshing = False

    def all(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            try:
                version = self.db.data_version()
                if version is not None and version != self._version:   # a local file changed elsewhere
                    self._cache, self._version = self._read(), version
            except Exception:   # keep the last copy
                logger.warning("reading moderation policies failed; using the last copy", exc_info=True)
                return dict(self._cache)
            if version is None and self._loaded_at is None:   # first use, or a change through this store
                self._cache = self._read()
                self._loaded_at = time.monotonic()
            elif version is None and time.monotonic() - self._loaded_at >= self.refresh_s and not self._refreshing:
                self._refreshing = True   # no change signal (PostgreSQL): replace the copy in the background
                threading.Thread(target=self._refresh, name="kvserve-policy-refresh", daemon=True).start()
            return dict(self._cache)

    def for_caller(self, key_name: str | None, tier: str | None) -> list[dict[str, Any]]:
        """The policies that apply, weakest first: the tier's, then the key's."""
        policies = self.all()
        return [p for p in (policies.get(f"tier:{tier}") if tier else None,
                            policies.get(key_name) if key_name else None) if p]


__all__ = ["FIELDS", "PolicyStore", "load_options", "policy_from_options", "validate"]
