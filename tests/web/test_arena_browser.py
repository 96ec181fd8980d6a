"""The Arena tab in headless Chromium against a live server with the real default model: two
anonymous answers stream side by side, the vote reveals the names, the leaderboard shows them."""

from __future__ import annotations

import json

import httpx
import pytest
from webpage import ARTIFACTS, open_page, run_server, wait_until

HEADERS = {"X-KVServe-Client": "web-test-stream"}
CONTESTANTS = [{"name": "terse", "system": "Answer in one word.", "temperature": 0.0, "max_tokens": 12},
               {"name": "chatty", "system": "Answer at length.", "temperature": 0.8, "max_tokens": 16}]


@pytest.fixture(scope="module")
def arena_server(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-data")
    (data_dir / "contestants.json").write_text(json.dumps(CONTESTANTS))
    with run_server(data_dir, "--arena-contestants", str(data_dir / "contestants.json")) as base:
        yield base


def test_arena_battle_vote_reveal_and_leaderboard(arena_server, browser):
    page, errors = open_page(browser, arena_server, "web-test-arena")
    page.click("#tab-arena")
    assert page.is_visible("#arena-view") and not page.is_visible("#composer")
    assert page.get_attribute("#tab-arena", "aria-selected") == "true"
    page.fill("#arena-prompt", "What is the capital of France?")
    page.keyboard.press("Enter")
    wait_until(page, "!document.getElementById('arena-votes').hidden", 180, "both answers done")
    answers = [page.inner_text(f"#arena-answer-{s}").strip() for s in "ab"]
    assert all(answers), answers
    names = [page.inner_text(f"#arena-name-{s}") for s in "ab"]
    assert names == ["Model A", "Model B"]                       # anonymous until the vote
    assert "terse" not in page.content() and "chatty" not in page.content()

    page.click("#arena-votes button[data-winner='a']")
    wait_until(page, "document.getElementById('arena-name-a').textContent.includes(':')", 30, "names revealed")
    a = page.inner_text("#arena-name-a").split(": ")[1]
    b = page.inner_text("#arena-name-b").split(": ")[1]
    assert {a, b} == {"terse", "chatty"}
    wait_until(page, "document.querySelectorAll('#arena-leaderboard tbody tr').length === 2", 30, "leaderboard")
    first = page.inner_text("#arena-leaderboard tbody tr:first-child")
    assert a in first                                               # the winner ranks first
    page.screenshot(path=str(ARTIFACTS / "web-arena.png"))

    stored = httpx.get(arena_server + "/v1/kvserve/arena/leaderboard",
                       headers={"X-KVServe-Client": "web-test-other"}).json()
    assert stored["votes"] == 1 and stored["data"][0]["model"] == a and stored["data"][0]["wins"] == 1
    page.click("#tab-chat")
    assert page.is_visible("#composer") and not page.is_visible("#arena-view")
    assert errors == []


def test_an_answer_stream_does_not_name_its_model(arena_server):
    """Every chunk of a side's answer says `arena-a` / `arena-b` where a chat stream names its model."""
    url = arena_server + "/v1/kvserve/arena"
    battle = httpx.post(url + "/battles", json={"prompt": "Name a colour."}, headers=HEADERS, timeout=30).json()
    for side in ("a", "b"):
        with httpx.stream("POST", f"{url}/battles/{battle['id']}/answers/{side}", headers=HEADERS, timeout=180) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert chunks and {c["model"] for c in chunks} == {f"arena-{side}"}, chunks[:2]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
