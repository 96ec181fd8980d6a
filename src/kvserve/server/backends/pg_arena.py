"""Arena battles and votes in PostgreSQL: arena.ArenaStore's API, so a battle started through one
server can be answered and voted on through another. A vote is one conditional UPDATE (`winner
IS NULL`), so two servers cannot both record one; `seq` stands in for SQLite's rowid in the
votes' order."""

from __future__ import annotations

import secrets
import time

from kvserve.errors import InvalidRequest
from kvserve.server.arena import BattleNotFound
from kvserve.server.arena_ratings import SCORES
from kvserve.server.backends.postgres import PostgresStore, pg_errors

COMPONENT = "arena"
MIGRATIONS: list[tuple[str, ...]] = [
    (  # 1: arena._SCHEMA
        """CREATE TABLE arena_battles (
            id          TEXT PRIMARY KEY,
            owner       TEXT NOT NULL,
            prompt      TEXT NOT NULL,
            model_a     TEXT NOT NULL,
            model_b     TEXT NOT NULL,
            winner      TEXT,
            created_at  DOUBLE PRECISION NOT NULL,
            voted_at    DOUBLE PRECISION,
            seq         BIGSERIAL)""",
        "CREATE INDEX arena_battles_voted ON arena_battles (voted_at)",
    ),
]


class PostgresArenaStore(PostgresStore):
    component, migrations = COMPONENT, MIGRATIONS

    @pg_errors
    def create(self, owner: str, prompt: str, model_a: str, model_b: str) -> str:
        if "\x00" in prompt:
            raise InvalidRequest("The prompt contains a NUL character, which cannot be stored; remove it.",
                                 param="prompt")
        battle_id = "battle-" + secrets.token_hex(12)
        with self.db.connection() as conn:
            conn.execute("INSERT INTO arena_battles (id, owner, prompt, model_a, model_b, created_at) "
                         "VALUES (%s, %s, %s, %s, %s, %s)", (battle_id, owner, prompt, model_a, model_b, time.time()))
        return battle_id

    @pg_errors
    def get(self, owner: str, battle_id: str) -> dict:
        with self.db.connection() as conn:
            row = conn.execute("SELECT id, prompt, model_a, model_b, winner FROM arena_battles "
                               "WHERE id = %s AND owner = %s", (battle_id, owner)).fetchone()
        if row is None:
            raise BattleNotFound(f"No arena battle {battle_id!r}; start one with POST /v1/kvserve/arena/battles.",
                                 param="id")
        return dict(row)

    @pg_errors
    def vote(self, owner: str, battle_id: str, winner: str) -> dict:
        if winner not in SCORES:
            raise InvalidRequest(f"winner must be one of {', '.join(SCORES)}", param="winner")
        battle = self.get(owner, battle_id)
        with self.db.connection() as conn:
            cur = conn.execute("UPDATE arena_battles SET winner = %s, voted_at = %s WHERE id = %s AND winner IS NULL",
                               (winner, time.time(), battle_id))
        if cur.rowcount == 0:
            raise InvalidRequest("This battle already has a vote; start a new one.", param="winner",
                                 code="already_voted")
        return {**battle, "winner": winner}

    def record(self, owner: str, model_a: str, model_b: str, winner: str, prompt: str = "") -> None:
        """A battle with its vote in one go (imports, simulations)."""
        self.vote(owner, self.create(owner, prompt, model_a, model_b), winner)

    @pg_errors
    def votes(self) -> list[tuple[str, str, str]]:
        with self.db.connection() as conn:
            rows = conn.execute("SELECT model_a, model_b, winner FROM arena_battles WHERE winner IS NOT NULL "
                                "ORDER BY voted_at, seq").fetchall()
        return [(r["model_a"], r["model_b"], r["winner"]) for r in rows]
