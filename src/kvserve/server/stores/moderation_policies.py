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
import pathlib
import threading
import time
from typing import Any

from kvserve.errors import InvalidRequest
from kvserve.safety.moderator import MODES
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
FIELDS = {"mode", "thresholds", "blocklist", "regexes", "pii_input", "pii_output", "jailbreak", "check_every",
          "window_chars", "action", "request_overrides"}


def validate(policy: dict[str, Any]) -> dict[str, Any]:
    """Raise InvalidRequest for an unknown field or value; returns the policy."""
    unknown = set(policy) - FIELDS
    if unknown:
        raise InvalidRequest(f"Unknown moderation policy field(s): {', '.join(sorted(unknown))}.", param="policy")
    if "mode" in policy and policy["mode"] not in MODES:
        raise InvalidRequest("mode must be input,output | input | output | off.", param="mode")
    if policy.get("pii_input", "off") not in ("off", "flag", "redact"):
        raise InvalidRequest("pii_input must be off, flag or redact.", param="pii_input")
    if policy.get("pii_output", "off") not in ("off", "redact"):
        raise InvalidRequest("pii_output must be off or redact.", param="pii_output")
    if policy.get("action", "block") not in ("block", "annotate"):
        raise InvalidRequest("action must be block or annotate.", param="action")
    if not isinstance(policy.get("request_overrides", True), bool):
        raise InvalidRequest("request_overrides must be true or false.", param="request_overrides")
    for cat, v in (policy.get("thresholds") or {}).items():
        if not isinstance(v, int | float) or not 0 <= v <= 1:
            raise InvalidRequest(f"The threshold of {cat} must be a number in [0, 1].", param="thresholds")
    if "check_every" in policy and (not isinstance(policy["check_every"], int) or policy["check_every"] < 1):
        raise InvalidRequest("check_every must be a positive number of tokens.", param="check_every")
    return policy


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


def _pairs(items: list[str] | None, what: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items or []:
        cat, sep, value = item.partition("=")
        if not sep or not cat or not value:
            raise InvalidRequest(f"--{what} takes CATEGORY=VALUE, got {item!r}.", param=what)
        out.setdefault(cat, []).append(value)
    return out


def policy_from_options(mode: str | None, threshold: list[str] | None, block: list[str] | None,
                        regex: list[str] | None, pii_input: str | None, pii_output: str | None,
                        check_every: int | None, action: str | None = None,
                        request_overrides: bool | None = None) -> dict[str, Any]:
    """A policy from `kvserve keys moderation` options (only what was given)."""
    policy: dict[str, Any] = {}
    if mode is not None:
        policy["mode"] = mode
    if threshold:
        try:
            policy["thresholds"] = {c: float(v[-1]) for c, v in _pairs(threshold, "threshold").items()}
        except ValueError:
            raise InvalidRequest("--threshold takes CATEGORY=NUMBER.", param="threshold") from None
    if block:
        policy["blocklist"] = _pairs(block, "block")
    if regex:
        policy["regexes"] = _pairs(regex, "regex")
    if pii_input is not None:
        policy["pii_input"] = pii_input
    if pii_output is not None:
        policy["pii_output"] = pii_output
    if check_every is not None:
        policy["check_every"] = check_every
    if action is not None:
        policy["action"] = action
    if request_overrides is not None:
        policy["request_overrides"] = request_overrides
    return validate(policy)


def load_options(mode: str, config_file: str | None) -> dict[str, Any]:
    """`kvserve serve --moderation MODE --moderation-config FILE` as ModerationConfig overrides."""
    if mode not in MODES:
        raise InvalidRequest("--moderation must be input,output | input | output | off.", param="moderation")
    if not config_file:
        return {}
    try:
        options = json.loads(pathlib.Path(config_file).read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"--moderation-config {config_file}: {e}", param="moderation_config") from None
    if not isinstance(options, dict):
        raise InvalidRequest("--moderation-config must hold a JSON object.", param="moderation_config")
    options.pop("mode", None)
    return validate(options)
