"""API keys and the usage ledger in PostgreSQL: the same `KeyBackend` as keys.KeyStore (SQLite).

Several servers (and the `kvserve keys --database-url` CLI) share the tables, so nothing is
cached here beyond "auth is on" (keys are never deleted, so that never turns back off): each
lookup is one indexed query on the key's SHA-256 hash, and a revocation is seen by the next
request. Put Redis in front (`--redis-url`, redis_state.CachedKeyStore) to spare the database
that query. Ledger rows are upserted with `ON CONFLICT DO UPDATE ... + excluded`, so concurrent
replicas add up rather than overwrite, and each upsert commits before the response that it
accounts for is sent (handlers._release): a crash loses no answered request's usage.
"""

from __future__ import annotations

import time

from kvserve.server.backends.postgres import Database, PostgresStore, pg_errors
from kvserve.server.keys import ANONYMOUS, ApiKey, duplicate_key, hash_key, new_key, today

COMPONENT = "keys"
MIGRATIONS: list[tuple[str, ...]] = [
    (  # 1: the tables of keys.SCHEMA
        """CREATE TABLE api_keys (
            name TEXT PRIMARY KEY,
            key_hash TEXT NOT NULL UNIQUE,
            prefix TEXT NOT NULL,
            tier TEXT NOT NULL DEFAULT 'paid',
            rpm INTEGER,
            tpm INTEGER,
            created_at DOUBLE PRECISION NOT NULL,
            revoked_at DOUBLE PRECISION)""",
        """CREATE TABLE usage_ledger (
            key_name TEXT NOT NULL,
            day TEXT NOT NULL,
            requests BIGINT NOT NULL DEFAULT 0,
            prompt_tokens BIGINT NOT NULL DEFAULT 0,
            completion_tokens BIGINT NOT NULL DEFAULT 0,
            cached_tokens BIGINT NOT NULL DEFAULT 0,
            PRIMARY KEY (key_name, day))""",
    ),
]

_KEY_COLS = "name, tier, rpm, tpm, prefix, created_at, revoked_at"
_USAGE_COLS = ("key_name", "day", "requests", "prompt_tokens", "completion_tokens", "cached_tokens")


class PostgresKeyStore(PostgresStore):
    component, migrations = COMPONENT, MIGRATIONS

    def __init__(self, url: str, *, db: Database | None = None):
        self._any_key = False
        super().__init__(url, db=db)

    @pg_errors
    def create(self, name: str, *, tier: str = "paid", rpm: int | None = None, tpm: int | None = None) -> str:
        import psycopg

        key = new_key(name, tier, rpm, tpm)
        try:
            with self.db.connection() as conn:
                conn.execute("INSERT INTO api_keys (name, key_hash, prefix, tier, rpm, tpm, created_at) "
                             "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                             (name, hash_key(key), key[:8], tier, rpm, tpm, time.time()))
        except psycopg.errors.UniqueViolation:
            raise duplicate_key(name) from None
        return key

    @pg_errors
    def revoke(self, name: str) -> bool:
        with self.db.connection() as conn:
            cur = conn.execute("UPDATE api_keys SET revoked_at = %s WHERE name = %s AND revoked_at IS NULL",
                               (time.time(), name))
            return cur.rowcount > 0

    @pg_errors
    def list(self) -> list[ApiKey]:
        with self.db.connection() as conn:
            rows = conn.execute(f"SELECT {_KEY_COLS} FROM api_keys ORDER BY name").fetchall()
        return [ApiKey(**row) for row in rows]

    @pg_errors
    def auth_required(self) -> bool:
        if not self._any_key:
            with self.db.connection() as conn:
                self._any_key = conn.execute("SELECT EXISTS (SELECT 1 FROM api_keys) AS any").fetchone()["any"]
        return self._any_key

    @pg_errors
    def lookup(self, presented: str) -> ApiKey | None:
        with self.db.connection() as conn:
            row = conn.execute(f"SELECT {_KEY_COLS} FROM api_keys WHERE key_hash = %s AND revoked_at IS NULL",
                               (hash_key(presented),)).fetchone()
        return ApiKey(**row) if row else None

    @pg_errors
    def record_usage(self, key_name: str | None, prompt_tokens: int, completion_tokens: int,
                     cached_tokens: int, *, requests: int = 1) -> None:
        with self.db.connection() as conn:
            conn.execute(
                "INSERT INTO usage_ledger (key_name, day, requests, prompt_tokens, completion_tokens,"
                " cached_tokens) VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (key_name, day) DO UPDATE SET"
                " requests = usage_ledger.requests + excluded.requests,"
                " prompt_tokens = usage_ledger.prompt_tokens + excluded.prompt_tokens,"
                " completion_tokens = usage_ledger.completion_tokens + excluded.completion_tokens,"
                " cached_tokens = usage_ledger.cached_tokens + excluded.cached_tokens",
                (key_name or ANONYMOUS, today(), requests, prompt_tokens, completion_tokens, cached_tokens))

    @pg_errors
    def usage(self, key_name: str | None = None) -> list[dict]:
        sql = f"SELECT {', '.join(_USAGE_COLS)} FROM usage_ledger"
        args: tuple = ()
        if key_name is not None:
            sql += " WHERE key_name = %s"
            args = (key_name,)
        with self.db.connection() as conn:
            rows = conn.execute(sql + " ORDER BY day, key_name", args).fetchall()
        return [{c: (int(row[c]) if c not in ("key_name", "day") else row[c]) for c in _USAGE_COLS} for row in rows]
