"""The Arena tab in headless Chromium against a live server with the real default model: two
anonymous answers stream side by side, the vote reveals the names, the leaderboard shows them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from test_browser import (  # noqa: F401 - browser is a fixture
    ARTIFACTS,
    CHROMIUM,
    _free_port,
    browser,
    open_page,
    wait_until,
)

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason="needs Debian's chromium (scripts/test-deps.sh installs it)")

CONTESTANTS = [{"name": "terse", "system": "Answer in one word.", "temperature": 0.0, "max_tokens": 12},
               {"name": "chatty", "system": "Answer at length.", "temperature": 0.8, "max_tokens": 16}]


@pytest.fixture(scope="module")
def arena_server(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-data")
    (data_dir / "contestants.json").write_text(json.dumps(CONTESTANTS))
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = data_dir / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.server", "serve", "--port", str(port),
                                 "--data-dir", str(data_dir), "--arena-contestants",
                                 str(data_dir / "contestants.json")], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"kvserve serve exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy in time:\n{log_path.read_text()}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_arena_battle_vote_reveal_and_leaderboard(arena_server, browser):  # noqa: F811 - fixture
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
