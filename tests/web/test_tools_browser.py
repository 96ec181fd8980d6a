"""Tool calling in the chat page (real browser, real server, the real default model): the person
defines a tool from a preset, the model's call (forced with a named tool_choice, greedy) is shown
with its name and arguments, the person's result goes back as a `tool` message that the model reads,
the conversation continues, and all of it is stored with the conversation."""

from __future__ import annotations

import json

import httpx
import pytest
from webpage import ARTIFACTS, open_page, run_server, wait_until

CLIENT = "web-test-tools"
DONE = "!!document.querySelector('.msg.assistant[data-index=\"{i}\"]:not(.streaming) .inspect')"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("tools-web"), "--moderation", "off", "--semantic-cache", "off") as base:
        yield base


def test_tool_call_shown_answered_and_stored(server, browser):
    page, errors = open_page(browser, server, CLIENT, settings={"max_tokens": 48, "temperature": 0})
    page.click("#open-tools")
    page.click("#tools-dialog [data-preset='weather']")
    page.select_option("#tool-choice", "fn:get_weather")
    page.click("#save-tools")
    assert page.text_content("#tools-count") == "1"

    page.fill("#prompt", "What is the weather like in Paris today?")
    page.keyboard.press("Enter")
    wait_until(page, DONE.format(i=1), 180, "tool call answered")
    call = page.locator(".msg.assistant[data-index='1'] .tool-call")
    assert call.count() == 1
    assert call.locator(".tool-call-name").text_content() == "get_weather"
    args = json.loads(call.locator(".tool-call-args").text_content())
    assert isinstance(args.get("city"), str) and args["city"]          # the tool's schema: city is required
    assert set(args) <= {"city", "unit"}

    page.fill(".tool-result-input", '{"temperature_c": 18, "sky": "sunny"}')
    page.click(".tool-result-send")
    wait_until(page, DONE.format(i=3), 180, "answer after the tool result")
    assert "sunny" in page.text_content(".msg.tool .tool-result-text")
    assert page.locator(".tool-result-form").count() == 0              # the last answer is not a call
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-chat-tool-call.png"))

    conv_id = page.evaluate("new URLSearchParams(location.hash.slice(1)).get('c')")
    conv = httpx.get(f"{server}/v1/kvserve/conversations/{conv_id}", headers={"X-KVServe-Client": CLIENT},
                     timeout=10).json()
    assert [t["function"]["name"] for t in conv["settings"]["tools"]] == ["get_weather"]
    assert conv["settings"]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    user, asst, tool, answer = conv["messages"]
    assert (user["role"], asst["role"], tool["role"], answer["role"]) == ("user", "assistant", "tool", "assistant")
    (stored_call,) = asst["meta"]["tool_calls"]
    assert stored_call["name"] == "get_weather" and json.loads(stored_call["arguments"]) == args
    assert asst["meta"]["finish_reason"] == "tool_calls"
    assert tool["meta"] == {"tool_call_id": stored_call["id"], "name": "get_weather"}
    # the model read the result: the follow-up's prompt holds the call and the tool response
    prompt = "".join(t["text"] for t in answer["trace"]["prompt_tokens"])
    assert "<tool_response>" in prompt and "sunny" in prompt and "get_weather" in prompt
    assert answer["meta"]["finish_reason"] in ("stop", "length", "tool_calls")

    page.reload()                                                      # stored with the conversation
    wait_until(page, "document.querySelectorAll('.msg').length === 4", 30, "reloaded conversation")
    assert page.text_content(".msg.assistant[data-index='1'] .tool-call-name") == "get_weather"
    assert "sunny" in page.text_content(".msg.tool .tool-result-text")
    assert page.text_content("#tools-count") == "1"
    assert errors == []


def test_bad_tools_json_is_refused_in_the_dialog(server, browser):
    page, errors = open_page(browser, server, CLIENT + "-bad")
    page.click("#open-tools")
    page.fill("#tools-json", '[{"type": "function", "function": {"name": "has space"}}]')
    page.click("#save-tools")
    assert page.evaluate("document.getElementById('tools-dialog').open")   # not closed
    assert "function.name" in page.text_content("#tools-note")
    page.fill("#tools-json", "[1,")
    assert "not valid JSON" in page.text_content("#tools-note")
    page.click("#tools-dialog button[value='cancel']")
    assert page.locator("#tools-count").is_hidden()
    assert errors == []
