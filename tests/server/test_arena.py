"""The arena's API on a real gateway (no model) and its ratings: votes stored per owner, names hidden
until the vote, and a leaderboard that recovers planted strengths from 1,000 simulated votes. The
gateway runs on the embedded stores (SQLite) and on the shared ones (PostgreSQL + Redis)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from kvserve.server.api.arena import DEFAULT_CONTESTANTS
from kvserve.server.stores.arena_ratings import leaderboard

ALICE = {"X-KVServe-Client": "arena-alice-0001"}
BOB = {"X-KVServe-Client": "arena-bob-000002"}


@pytest.fixture(scope="module")
def gateway(gateway_on_each_backend):
    return gateway_on_each_backend


PLANTED = {"alpha": 1250.0, "bravo": 1100.0, "charlie": 1000.0, "delta": 950.0, "echo": 800.0}


def simulate(n: int, seed: int) -> list[tuple[str, str, str]]:
    """n votes between random pairs, the winner drawn from the Bradley-Terry (Elo-scale) odds."""
    rng = np.random.default_rng(seed)
    names = list(PLANTED)
    votes = []
    for _ in range(n):
        i, j = rng.choice(len(names), 2, replace=False)
        a, b = names[i], names[j]
        p_a = 1 / (1 + 10 ** ((PLANTED[b] - PLANTED[a]) / 400))
        votes.append((a, b, "a" if rng.random() < p_a else "b"))
    return votes


def test_leaderboard_recovers_planted_strengths_from_1000_votes(gateway):
    store = gateway.app.state.arena_store   # the server's own: SQLite, or PostgreSQL
    for a, b, winner in simulate(1000, seed=7):
        store.record("client:simulator", a, b, winner)
    r = httpx.get(gateway.base_url + "/v1/kvserve/arena/leaderboard", headers=ALICE, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["votes"] == 1000
    rows = body["data"]
    assert [row["model"] for row in rows] == sorted(PLANTED, key=lambda m: -PLANTED[m])   # the planted order
    center = 1000 - np.mean(list(PLANTED.values()))      # ratings are reported with mean 1000
    for row in rows:
        planted = PLANTED[row["model"]] + center
        assert row["ci_lower"] <= planted <= row["ci_upper"], row
        assert row["ci_lower"] <= row["rating"] <= row["ci_upper"]
        assert abs(row["elo"] - planted) < 150, row                   # online Elo lands near it too
    assert sum(row["battles"] for row in rows) == 2000
    assert [row["rank"] for row in rows] == [1, 2, 3, 4, 5]


def test_ties_and_both_bad_count_half_each_way():
    rows = leaderboard([("x", "y", "tie"), ("y", "x", "both_bad"), ("x", "y", "a"), ("x", "y", "b")], rounds=20)
    assert rows[0]["rating"] == pytest.approx(rows[1]["rating"]) == pytest.approx(1000.0)
    assert {r["ties"] for r in rows} == {2}
    assert leaderboard([]) == []


def test_battles_hide_names_until_the_vote_and_belong_to_their_owner(gateway):
    url = gateway.base_url + "/v1/kvserve/arena"
    names = {c.name for c in DEFAULT_CONTESTANTS}
    battle = httpx.post(url + "/battles", json={"prompt": "Name a colour."}, headers=ALICE).json()
    assert set(battle) == {"id", "object", "sides"}                    # nothing says who is who
    assert httpx.post(f"{url}/battles/{battle['id']}/vote", json={"winner": "a"}, headers=BOB).status_code == 404
    bad = httpx.post(f"{url}/battles/{battle['id']}/vote", json={"winner": "A"}, headers=ALICE)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "winner"
    early = httpx.post(f"{url}/battles/{battle['id']}/vote", json={"winner": "tie"}, headers=ALICE)
    assert early.status_code == 409 and early.json()["error"]["code"] == "answers_not_generated"
    for side in "ab":   # as the answer routes do once a side's stream ended (this gateway has no model)
        gateway.app.state.arena_store.answered(battle["id"], side)
    r = httpx.post(f"{url}/battles/{battle['id']}/vote", json={"winner": "tie"}, headers=ALICE)
    assert r.status_code == 200
    revealed = r.json()
    assert {revealed["model_a"], revealed["model_b"]} <= names and revealed["model_a"] != revealed["model_b"]
    again = httpx.post(f"{url}/battles/{battle['id']}/vote", json={"winner": "b"}, headers=ALICE)
    assert again.status_code == 400 and again.json()["error"]["code"] == "already_voted"
    over = httpx.post(f"{url}/battles/{battle['id']}/answers/a", headers=ALICE)
    assert over.status_code == 400


@pytest.mark.parametrize(("path", "body", "headers", "status"), [
    ("/battles", {"prompt": "hi"}, {}, 400),                       # no owner: neither key nor browser id
    ("/battles", {"prompt": "  "}, ALICE, 400),
    ("/battles", {"prompt": 3}, ALICE, 400),
    ("/battles", {"prompt": "x" * 9000}, ALICE, 400),
    ("/battles/battle-nope/vote", {"winner": "a"}, ALICE, 404),
    ("/battles/battle-nope/answers/a", {}, ALICE, 404),
])
def test_bad_arena_requests_get_clear_errors(gateway, path, body, headers, status):
    r = httpx.post(gateway.base_url + "/v1/kvserve/arena" + path, json=body, headers=headers)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


def test_answer_without_a_model_is_503_not_500(gateway):
    url = gateway.base_url + "/v1/kvserve/arena"
    battle = httpx.post(url + "/battles", json={"prompt": "Hello?"}, headers=ALICE).json()
    r = httpx.post(f"{url}/battles/{battle['id']}/answers/b", headers=ALICE)
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
    assert httpx.post(f"{url}/battles/{battle['id']}/answers/c", headers=ALICE).status_code == 400
