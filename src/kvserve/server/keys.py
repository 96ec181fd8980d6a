"""API keys and the usage ledger, in one SQLite file (WAL mode) under the data dir.

Keys are stored only as SHA-256 hashes: they are 256-bit random strings, so a fast hash is as
strong as a slow KDF here, and lookup stays cheap on every request. A presented key is hashed and
compared with `hmac.compare_digest` against every stored hash (no early exit), so timing reveals
neither which key matched nor how much of it. The server keeps the keys in memory and reloads them
when `PRAGMA data_version` says another connection (the `kvserve keys` CLI) committed a change.

Auth is required once any key has ever been created (a revoked key still counts, so revoking
the last key does not silently open the server).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import pathlib
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass

from kvserve.errors import InvalidRequest
from kvserve.server import storage

SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    name TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL UNIQUE,
    prefix TEXT NOT NULL,
    tier TEXT NOT NULL DEFAULT 'paid',
    rpm INTEGER,
    tpm INTEGER,
    created_at REAL NOT NULL,
    revoked_at REAL
);
CREATE TABLE IF NOT EXISTS usage_ledger (
    key_name TEXT NOT NULL,
    day TEXT NOT NULL,
    requests INTEGER NOT NULL DEFAULT 0,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (key_name, day)
);
"""

TIERS = ("paid", "free")
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


class KeyStore:
    """The embedded key store and usage ledger (SQLite). Other stores implement the same methods
    (backends/base.py `KeyBackend`; backends/pg_keys.py for PostgreSQL)."""

    def __init__(self, db_path: pathlib.Path):
        self.db_path = pathlib.Path(db_path)
        self._lock = threading.Lock()
        self._conn = storage.connect(self.db_path, check_same_thread=False, isolation_level=None,
                                     timeout=10.0)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")  # durable across a process kill in WAL mode
        self._conn.executescript(SCHEMA)
        self._version: int | None = None
        self._active: list[tuple[str, ApiKey]] = []
        self._any_key = False

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # --- administration (the CLI) ---

    def create(self, name: str, *, tier: str = "paid", rpm: int | None = None,
               tpm: int | None = None) -> str:
        """Create a key and return it; only its hash is stored, so this is the one time it is seen."""
        key = new_key(name, tier, rpm, tpm)
        with self._lock:
            try:
                self._conn.execute(
                    "INSERT INTO api_keys (name, key_hash, prefix, tier, rpm, tpm, created_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (name, hash_key(key), key[:8], tier, rpm, tpm, time.time()))
                self._version = None  # data_version only moves for other connections' commits
            except sqlite3.IntegrityError:
                raise duplicate_key(name) from None
        return key

    def revoke(self, name: str) -> bool:
        with self._lock:
            cur = self._conn.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL",
                (time.time(), name))
            self._version = None
            return cur.rowcount > 0

    def list(self) -> list[ApiKey]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT name, tier, rpm, tpm, prefix, created_at, revoked_at FROM api_keys ORDER BY name"
            ).fetchall()
        return [ApiKey(*row) for row in rows]

    # --- the request path ---

    def _refresh(self) -> None:
        version = self._conn.execute("PRAGMA data_version").fetchone()[0]
        if version == self._version:
            return
        rows = self._conn.execute(
            "SELECT key_hash, name, tier, rpm, tpm, prefix, created_at, revoked_at FROM api_keys"
        ).fetchall()
        self._any_key = bool(rows)
        self._active = [(row[0], ApiKey(*row[1:])) for row in rows if row[7] is None]
        self._version = version

    def auth_required(self) -> bool:
        with self._lock:
            self._refresh()
            return self._any_key

    def lookup(self, presented: str) -> ApiKey | None:
        """The active key matching `presented`, compared in constant time against every stored hash."""
        digest = hash_key(presented).encode()
        with self._lock:
            self._refresh()
            found = None
            for key_hash, key in self._active:
                if hmac.compare_digest(digest, key_hash.encode()):
                    found = key
            return found

    # --- usage ledger ---

    def record_usage(self, key_name: str | None, prompt_tokens: int, completion_tokens: int,
                     cached_tokens: int, *, requests: int = 1) -> None:
        day = today()
        with self._lock:
            self._conn.execute(
                "INSERT INTO usage_ledger (key_name, day, requests, prompt_tokens, completion_tokens,"
                " cached_tokens) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(key_name, day) DO UPDATE SET"
                " requests = requests + excluded.requests,"
                " prompt_tokens = prompt_tokens + excluded.prompt_tokens,"
                " completion_tokens = completion_tokens + excluded.completion_tokens,"
                " cached_tokens = cached_tokens + excluded.cached_tokens",
                (key_name or ANONYMOUS, day, requests, prompt_tokens, completion_tokens, cached_tokens))

    def usage(self, key_name: str | None = None) -> list[dict]:
        sql = ("SELECT key_name, day, requests, prompt_tokens, completion_tokens, cached_tokens"
               " FROM usage_ledger")
        args: tuple = ()
        if key_name is not None:
            sql += " WHERE key_name = ?"
            args = (key_name,)
        with self._lock:
            rows = self._conn.execute(sql + " ORDER BY day, key_name", args).fetchall()
        cols = ("key_name", "day", "requests", "prompt_tokens", "completion_tokens", "cached_tokens")
        return [dict(zip(cols, row)) for row in rows]
