"""API keys and the usage ledger (tables `api_keys`, `usage_ledger`): in the server's SQLite file,
or in PostgreSQL with --database-url, shared by every server and the `kvserve keys` CLI.

Keys are stored only as SHA-256 hashes: they are 256-bit random strings, so a fast hash is as
strong as a slow KDF here, and lookup stays cheap on every request. How a presented key is found
depends on what the database can tell cheaply:
* SQLite (a local file, `data_version` moves when another connection commits): the server keeps
  the keys in memory and reloads them when the CLI changed them; a presented key is hashed and
  compared with `hmac.compare_digest` against every stored hash (no early exit), so timing
  reveals neither which key matched nor how much of it.
* PostgreSQL (shared, no change signal): each lookup is one indexed query on the key's hash, so
  a revocation made anywhere is seen by the next request. Put Redis in front (`--redis-url`,
  redis_state.CachedKeyStore) to spare the database that query.

Auth is required once any key has ever been created (a revoked key still counts, so revoking
the last key does not silently open the server; keys are never deleted, so that answer is kept).
Ledger rows are upserted with `ON CONFLICT DO UPDATE ... + excluded`, so concurrent servers add
up rather than overwrite, and each upsert commits before the response it accounts for is sent.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from kvserve.errors import InvalidRequest
from kvserve.server.stores.sql import Conflict, SQLStore, Steps

STEPS: Steps = [
    (  # 1
        """CREATE TABLE IF NOT EXISTS api_keys (
    name TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL UNIQUE,
    prefix TEXT NOT NULL,
    tier TEXT NOT NULL DEFAULT 'paid',
    rpm INTEGER,
    tpm INTEGER,
    created_at $time NOT NULL,
    revoked_at $time
)""",
        """CREATE TABLE IF NOT EXISTS usage_ledger (
    key_name TEXT NOT NULL,
    day TEXT NOT NULL,
    requests $bigint NOT NULL DEFAULT 0,
    prompt_tokens $bigint NOT NULL DEFAULT 0,
    completion_tokens $bigint NOT NULL DEFAULT 0,
    cached_tokens $bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (key_name, day)
)""",
    ),
]
_KEY_COLS = "name, tier, rpm, tpm, prefix, created_at, revoked_at"
_USAGE_COLS = ("key_name", "day", "requests", "prompt_tokens", "completion_tokens", "cached_tokens")

TIERS = ("paid", "free")
CLI_KEY_NAME = "api-key"   # the identity of `kvserve serve --api-key`: no database key may take it
ANONYMOUS = "(anonymous)"  # ledger name for requests when auth is off


@dataclass
class ApiKey:
    name: str
    tier: str = "paid"
    rpm: int | None = None
    tpm: int | None = None
    prefix: str = ""
    created_at: float = 0.0
    revoked_at: float | None = None


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def new_key(name: str, tier: str, rpm: int | None, tpm: int | None) -> str:
    """Check a new key's fields (InvalidRequest with `param` when wrong) and draw the key."""
    if not name or len(name) > 64 or not all(c.isalnum() or c in "-_." for c in name):
        raise InvalidRequest("Key names are 1-64 characters of letters, digits, '-', '_' or '.'.",
                             param="name")
    if name == CLI_KEY_NAME:
        raise InvalidRequest(f"The key name {CLI_KEY_NAME!r} is reserved for `kvserve serve --api-key`; pick "
                             "another.", param="name")
    if tier not in TIERS:
        raise InvalidRequest(f"Tier must be one of {', '.join(TIERS)}.", param="tier")
    for label, value in (("rpm", rpm), ("tpm", tpm)):
        if value is not None and value <= 0:
            raise InvalidRequest(f"--{label} must be a positive integer.", param=label)
    return "kvs-" + secrets.token_urlsafe(32)


def duplicate_key(name: str) -> InvalidRequest:
    return InvalidRequest(f"A key named {name!r} already exists; pick another name or "
                          f"revoke it first with `kvserve keys revoke {name}`.", param="name")


def today() -> str:
    """The usage ledger's day (UTC)."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")


class KeyBackend(Protocol):
    """What the gateway and the CLI use: a KeyStore, or redis_state.CachedKeyStore in front of one."""

    def create(self, name: str, *, tier: str = "paid", rpm: int | None = None,
               tpm: int | None = None) -> str: ...
    def revoke(self, name: str) -> bool: ...
    def list(self) -> list[ApiKey]: ...
    def auth_required(self) -> bool: ...
    def lookup(self, presented: str) -> ApiKey | None: ...
    def record_usage(self, key_name: str | None, prompt_tokens: int, completion_tokens: int,
                     cached_tokens: int, *, requests: int = 1) -> None: ...
    def usage(self, key_name: str | None = None) -> list[dict]: ...
    def close(self) -> None: ...


class KeyStore(SQLStore):
    """The keys and the usage ledger on one database (see the module's docstring)."""

    component, steps = "keys", STEPS

    def __init__(self, db) -> None:
        self._lock = threading.Lock()
        self._version: int | None = None          # SQLite: the data_version the snapshot is of
        self._active: list[tuple[str, ApiKey]] = []
        self._any_key = False
        super().__init__(db)

    # --- administration (the CLI) ---

    def create(self, name: str, *, tier: str = "paid", rpm: int | None = None,
               tpm: int | None = None) -> str:
        """Create a key and return it; only its hash is stored, so this is the one time it is seen."""
        key = new_key(name, tier, rpm, tpm)
        try:
            with self.db.connection() as conn:
                conn.execute("INSERT INTO api_keys (name, key_hash, prefix, tier, rpm, tpm, created_at)"
                             " VALUES (?, ?, ?, ?, ?, ?, ?)", (name, hash_key(key), key[:8], tier, rpm, tpm, time.time()))
        except Conflict:
            raise duplicate_key(name) from None
        self._version = None   # data_version only moves for other connections' commits
        return key

    def revoke(self, name: str) -> bool:
        with self.db.connection() as conn:
            cur = conn.execute("UPDATE api_keys SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL",
                               (time.time(), name))
        self._version = None
        return cur.rowcount > 0

    def list(self) -> list[ApiKey]:
        with self.db.connection() as conn:
            rows = conn.execute(f"SELECT {_KEY_COLS} FROM api_keys ORDER BY name").fetchall()
        return [ApiKey(**row) for row in rows]

    # --- the request path ---

    def _snapshot(self) -> list[tuple[str, ApiKey]] | None:
        """The active keys with their hashes, reloaded when another connection committed; None
        when the database has no cheap change signal (PostgreSQL: ask it per lookup)."""
        with self._lock:
            version = self.db.data_version()
            if version is None:
                return None
            if version != self._version:
                with self.db.connection() as conn:
                    rows = conn.execute(f"SELECT key_hash, {_KEY_COLS} FROM api_keys").fetchall()
                self._any_key = bool(rows)
                self._active = [(row.pop("key_hash"), ApiKey(**row)) for row in rows if row["revoked_at"] is None]
                self._version = version
            return self._active

    def auth_required(self) -> bool:
        if not self._any_key and self._snapshot() is None:
            with self.db.connection() as conn:
                self._any_key = bool(conn.execute("SELECT EXISTS (SELECT 1 FROM api_keys) AS found"
                                                  ).fetchone()["found"])
        return self._any_key

    def lookup(self, presented: str) -> ApiKey | None:
        """The active key matching `presented`."""
        active = self._snapshot()
        if active is None:
            with self.db.connection() as conn:
                row = conn.execute(f"SELECT {_KEY_COLS} FROM api_keys WHERE key_hash = ? AND revoked_at IS NULL",
                                   (hash_key(presented),)).fetchone()
            return ApiKey(**row) if row else None
        digest = hash_key(presented).encode()
        found = None
        for key_hash, key in active:   # every hash compared, in constant time
            if hmac.compare_digest(digest, key_hash.encode()):
                found = key
        return found

    # --- usage ledger ---

    def record_usage(self, key_name: str | None, prompt_tokens: int, completion_tokens: int,
                     cached_tokens: int, *, requests: int = 1) -> None:
        with self.db.connection() as conn:
            conn.execute(
                "INSERT INTO usage_ledger (key_name, day, requests, prompt_tokens, completion_tokens,"
                " cached_tokens) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key_name, day) DO UPDATE SET"
                " requests = usage_ledger.requests + excluded.requests,"
                " prompt_tokens = usage_ledger.prompt_tokens + excluded.prompt_tokens,"
                " completion_tokens = usage_ledger.completion_tokens + excluded.completion_tokens,"
                " cached_tokens = usage_ledger.cached_tokens + excluded.cached_tokens",
                (key_name or ANONYMOUS, today(), requests, prompt_tokens, completion_tokens, cached_tokens))

    def usage(self, key_name: str | None = None) -> list[dict]:
        sql = f"SELECT {', '.join(_USAGE_COLS)} FROM usage_ledger"
        args: tuple = ()
        if key_name is not None:
            sql += " WHERE key_name = ?"
            args = (key_name,)
        with self.db.connection() as conn:
            rows = conn.execute(sql + " ORDER BY day, key_name", args).fetchall()
        return [{c: row[c] if c in ("key_name", "day") else int(row[c]) for c in _USAGE_COLS} for row in rows]
