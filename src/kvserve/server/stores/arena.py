"""The arena's battles and votes (table `arena_battles`), in the server's SQLite file or in
PostgreSQL with --database-url (a battle started through one server can then be answered and
voted on through another). The routes are server/api/arena.py.

Each battle has its owner (the API key's name, or the browser id without auth: webui.owner_of);
only its owner can read it or vote, another owner's id is the same 404 as an unknown one. A
vote is one conditional UPDATE (`winner IS NULL`), so two servers cannot both record one. Votes
are read back in the order they were cast (then inserted), for the leaderboard.

A vote needs both answers generated (`answered`, table `arena_answers`: 409 before), so every
vote cost its owner two charged generations. Open (unvoted) battles are under a per-owner quota
(stores/quota.py: count, prompt bytes, and an expiry); a voted battle is a leaderboard row, bounded
by the generations it cost.
"""

from __future__ import annotations

import secrets
import time

from kvserve.errors import InvalidRequest, KVServeError
from kvserve.server.stores.arena_ratings import SCORES
from kvserve.server.stores.quota import DEFAULT_QUOTAS, OwnerQuota, QuotaLimits
from kvserve.server.stores.sql import SQLStore, Steps

STEPS: Steps = [
    (  # 1 ($seq: PostgreSQL's stand-in for SQLite's rowid in the votes' order)
        """CREATE TABLE IF NOT EXISTS arena_battles (
    id          TEXT PRIMARY KEY,
    owner       TEXT NOT NULL,
    prompt      TEXT NOT NULL,
    model_a     TEXT NOT NULL,
    model_b     TEXT NOT NULL,
    winner      TEXT,
    created_at  $time NOT NULL,
    voted_at    $time$seq
)""",
        "CREATE INDEX IF NOT EXISTS arena_battles_voted ON arena_battles(voted_at)",
    ),
    (  # 2: the sides whose answer was generated
        """CREATE TABLE IF NOT EXISTS arena_answers (
    battle_id TEXT NOT NULL REFERENCES arena_battles(id) ON DELETE CASCADE,
    side      TEXT NOT NULL,
    PRIMARY KEY (battle_id, side)
)""",
        "CREATE INDEX IF NOT EXISTS arena_battles_owner ON arena_battles(owner, created_at)",
    ),
]


class BattleNotFound(KVServeError, status=404, code="battle_not_found"):
    """No arena battle with this id (HTTP 404)."""


class AnswersPending(KVServeError, status=409, code="answers_not_generated"):
    """A vote before both answers were generated (HTTP 409)."""


class ArenaStore(SQLStore):
    component, steps = "arena", STEPS

    def __init__(self, db, quota: QuotaLimits | None = None):
        self.quota = OwnerQuota("arena_battles", quota or DEFAULT_QUOTAS["arena"], what="open arena battles",
                                param="prompt", text_columns=("prompt",), counted="winner IS NULL")
        super().__init__(db)

    def create(self, owner: str, prompt: str, model_a: str, model_b: str) -> str:
        """A new battle; 413 past the owner's quota of open battles."""
        self.db.check_text(prompt, "prompt", "The prompt")
        battle_id = "battle-" + secrets.token_hex(12)
        with self.db.transaction() as conn:
            self.quota.admit(self.db, conn, owner, len(prompt.encode()))
            conn.execute("INSERT INTO arena_battles (id, owner, prompt, model_a, model_b, created_at) "
                         "VALUES (?, ?, ?, ?, ?, ?)", (battle_id, owner, prompt, model_a, model_b, time.time()))
        return battle_id

    def get(self, owner: str, battle_id: str) -> dict:
        alive, args = self.quota.alive()
        with self.db.connection() as conn:
            row = conn.execute("SELECT id, prompt, model_a, model_b, winner FROM arena_battles "
                               f"WHERE id = ? AND owner = ?{alive}",
                               (battle_id, owner, *args)).fetchone()
        if row is None:
            raise BattleNotFound(f"No arena battle {battle_id!r}; start one with POST /v1/kvserve/arena/battles.",
                                 param="id")
        return row

    def answered(self, battle_id: str, side: str) -> None:
        """Side `side`'s answer was generated."""
        with self.db.connection() as conn:
            conn.execute("INSERT INTO arena_answers (battle_id, side) VALUES (?, ?) "
                         "ON CONFLICT (battle_id, side) DO NOTHING", (battle_id, side))

    def vote(self, owner: str, battle_id: str, winner: str, *, answers_needed: bool = True) -> dict:
        """Record the vote; 409 before both answers were generated, 400 when already voted."""
        if winner not in SCORES:
            raise InvalidRequest(f"winner must be one of {', '.join(SCORES)}", param="winner")
        battle = self.get(owner, battle_id)
        if answers_needed and battle["winner"] is None:
            with self.db.connection() as conn:
                n = conn.execute("SELECT COUNT(*) AS n FROM arena_answers WHERE battle_id = ?",
                                 (battle_id,)).fetchone()["n"]
            if n < 2:
                raise AnswersPending("Both answers must be generated before the vote: ask for "
                                     f"/v1/kvserve/arena/battles/{battle_id}/answers/a and /b first.", param="winner")
        with self.db.connection() as conn:
            cur = conn.execute("UPDATE arena_battles SET winner = ?, voted_at = ? WHERE id = ? AND winner IS NULL",
                               (winner, time.time(), battle_id))
        if cur.rowcount == 0:
            raise InvalidRequest("This battle already has a vote; start a new one.", param="winner",
                                 code="already_voted")
        return {**battle, "winner": winner}

    def record(self, owner: str, model_a: str, model_b: str, winner: str, prompt: str = "") -> None:
        """A battle with its vote in one go (imports, simulations)."""
        self.vote(owner, self.create(owner, prompt, model_a, model_b), winner, answers_needed=False)

    def votes(self) -> list[tuple[str, str, str]]:
        with self.db.connection() as conn:
            rows = conn.execute("SELECT model_a, model_b, winner FROM arena_battles WHERE winner IS NOT NULL "
                                f"ORDER BY voted_at, {self.db.insert_order}").fetchall()
        return [(r["model_a"], r["model_b"], r["winner"]) for r in rows]
