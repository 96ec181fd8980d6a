"""The arena's battles and votes, stored in the server's SQLite file (table `arena_battles`), each
with its owner (the API key's name, or the browser id without auth: webui.owner_of); a battle can
be answered and voted on only by its owner, and only once. The routes are in api/arena.py.
"""

from __future__ import annotations

import pathlib
import secrets
import sqlite3
import threading
import time

from kvserve.errors import InvalidRequest, KVServeError
from kvserve.server.arena_ratings import SCORES

_SCHEMA = """
CREATE TABLE IF NOT EXISTS arena_battles (
    id          TEXT PRIMARY KEY,
    owner       TEXT NOT NULL,
    prompt      TEXT NOT NULL,
    model_a     TEXT NOT NULL,
    model_b     TEXT NOT NULL,
    winner      TEXT,
    created_at  REAL NOT NULL,
    voted_at    REAL
);
CREATE INDEX IF NOT EXISTS arena_battles_voted ON arena_battles(voted_at);
"""


class BattleNotFound(KVServeError):
    status = 404
    code = "battle_not_found"


class ArenaStore:
    """Battles and votes in SQLite (the server's database file), one lock-guarded connection."""

    def __init__(self, db_path: pathlib.Path | str):
        pathlib.Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def create(self, owner: str, prompt: str, model_a: str, model_b: str) -> str:
        battle_id = "battle-" + secrets.token_hex(12)
        with self._lock:
            self._db.execute("INSERT INTO arena_battles (id, owner, prompt, model_a, model_b, created_at) "
                             "VALUES (?, ?, ?, ?, ?, ?)", (battle_id, owner, prompt, model_a, model_b, time.time()))
        return battle_id

    def get(self, owner: str, battle_id: str) -> dict:
        with self._lock:
            row = self._db.execute("SELECT id, prompt, model_a, model_b, winner FROM arena_battles "
                                   "WHERE id = ? AND owner = ?", (battle_id, owner)).fetchone()
        if row is None:
            raise BattleNotFound(f"No arena battle {battle_id!r}; start one with POST /v1/kvserve/arena/battles.",
                                 param="id")
        return dict(zip(("id", "prompt", "model_a", "model_b", "winner"), row))

    def vote(self, owner: str, battle_id: str, winner: str) -> dict:
        if winner not in SCORES:
            raise InvalidRequest(f"winner must be one of {', '.join(SCORES)}", param="winner")
        battle = self.get(owner, battle_id)
        with self._lock:
            cur = self._db.execute("UPDATE arena_battles SET winner = ?, voted_at = ? WHERE id = ? AND winner IS NULL",
                                   (winner, time.time(), battle_id))
        if cur.rowcount == 0:
            raise InvalidRequest("This battle already has a vote; start a new one.", param="winner",
                                 code="already_voted")
        return {**battle, "winner": winner}

    def record(self, owner: str, model_a: str, model_b: str, winner: str, prompt: str = "") -> None:
        """A battle with its vote in one go (imports, simulations)."""
        self.vote(owner, self.create(owner, prompt, model_a, model_b), winner)

    def votes(self) -> list[tuple[str, str, str]]:
        with self._lock:
            return self._db.execute("SELECT model_a, model_b, winner FROM arena_battles WHERE winner IS NOT NULL "
                                    "ORDER BY voted_at, rowid").fetchall()

    def close(self) -> None:
        self._db.close()
