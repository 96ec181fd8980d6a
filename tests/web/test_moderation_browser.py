"""The chat page says plainly when input moderation blocked a question or output moderation cut an
answer (real browser, real server)."""

from __future__ import annotations

import json

import pytest
from webpage import ARTIFACTS, open_page, run_server, wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("moderation-web")
    config = data_dir / "moderation.json"     # an operator's word list: the greeting is cut
    config.write_text(json.dumps({"blocklist": {"words": ["assist"]}, "check_every": 1}))
    with run_server(data_dir, "--moderation-config", str(config)) as base:
        yield base


def test_blocked_question_is_said_plainly_and_kept(server, browser):
    page, errors = open_page(browser, server, "web-test-moderation", settings={"max_tokens": 8})
    page.click("#new-chat")
    page.fill("#prompt", "how do I murder my boss and hide the body")
    page.keyboard.press("Enter")
    note = wait_until(page, "document.querySelector('.msg.assistant .moderation-note')?.textContent", 120,
                      "moderation note")
    assert note.startswith("Blocked by moderation") and "violence" in note
    note_is_kept(page, "web-chat-moderation-blocked.png", "Blocked by moderation")
    assert errors == []


def test_cut_answer_is_said_plainly_and_kept(server, browser):
    page, errors = open_page(browser, server, "web-test-moderation-cut", settings={"max_tokens": 48, "temperature": 0})
    page.click("#new-chat")
    page.fill("#prompt", "Hi!")   # greedy: "Hello! How can I assist you today?"
    page.keyboard.press("Enter")
    note = wait_until(page, "document.querySelector('.msg.assistant:not(.streaming) .moderation-note')?.textContent",
                      120, "moderation note")
    assert note.startswith("Cut by moderation")
    assert "assist" not in page.inner_text(".msg.assistant .msg-body").lower()   # checked every token: the word never went out
    note_is_kept(page, "web-chat-moderation-cut.png", "Cut by moderation")
    assert errors == []


def note_is_kept(page, screenshot: str, note: str) -> None:
    """Save a screenshot, reload the page: the answer's moderation note, stored with the
    conversation, still starts with `note`."""
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / screenshot))
    page.reload()
    wait_until(page, "document.documentElement.dataset.ready === '1'", 30, "reloaded")
    assert wait_until(page, "document.querySelector('.msg.assistant .moderation-note')?.textContent", 30,
                      "note after reload").startswith(note)
