"""The chat page in a real browser (Debian's Chromium, headless) against a live kvserve server
running the real default model. Screenshots go to test-artifacts/."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from webpage import ARTIFACTS, metric, open_page, run_server, set_settings_via_dialog, wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("kvserve-data")) as base:
        yield base


GROWTH_OBSERVER = """() => {
  window.__growth = [];
  new MutationObserver(() => {
    const body = document.querySelector('.msg.assistant.streaming .msg-body');
    if (body && window.__growth[window.__growth.length - 1] !== body.textContent) window.__growth.push(body.textContent);
  }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
}"""


def test_chat_streams_inspects_and_survives_reload(server, browser):
    page, errors = open_page(browser, server, "web-test-chat")
    assert page.locator("#model-select option").count() >= 1
    set_settings_via_dialog(page, max_tokens=24, temperature=0)
    page.evaluate(GROWTH_OBSERVER)
    page.fill("#prompt", "What is the capital of France?")
    page.keyboard.press("Enter")
    wait_until(page, "!!document.querySelector('.msg.assistant:not(.streaming) .inspect')", 180, "answer done")

    growth = page.evaluate("window.__growth")
    final = page.inner_text(".msg.assistant .msg-body")
    assert final.strip()
    assert len(growth) >= 3, f"answer arrived in {len(growth)} DOM update(s): {growth}"
    assert [len(g) for g in growth] == sorted(len(g) for g in growth)  # it grows, never shrinks

    page.click(".msg.assistant .inspect")
    stat = {page.inner_text(f".stat:nth-child({i}) .stat-label"): page.inner_text(f".stat:nth-child({i}) .stat-value")
            for i in range(1, 7)}
    ttft = re.match(r"([0-9.]+) (ms|s)", stat["Time to first token"])
    assert ttft and float(ttft.group(1)) > 0, stat
    n_prompt = int(stat["Prompt tokens"])
    assert n_prompt > 5 and page.locator("#inspector .chip:not(.legend-chip)").count() == n_prompt
    assert int(page.inner_text("#inspector .chip:not(.legend-chip) .chip-id >> nth=0")) >= 0
    assert page.locator(".tl-row").count() >= 6  # 5 stages + TTFT + total
    assert page.locator(".out-tok").count() == int(stat["Output tokens"]) > 0

    page.hover(".out-tok >> nth=1")
    assert page.is_visible("#token-tooltip")
    alts = page.locator("#token-tooltip tr.alt")
    assert alts.count() == 5
    assert re.fullmatch(r"[0-9.]+%", page.inner_text("#token-tooltip tr.alt >> nth=0 >> .alt-prob"))
    assert page.locator("#token-tooltip tr.alt.chosen").count() == 1  # temperature 0: greedy = top-1
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-chat-inspector.png"))

    # Focus works as hover does (keyboard users).
    page.mouse.move(0, 0)
    page.focus(".out-tok >> nth=2")
    assert page.locator("#token-tooltip tr.alt").count() == 5

    # A follow-up turn reuses the first turn's prompt from the prefix cache; the chips say so.
    page.keyboard.press("Escape")
    page.fill("#prompt", "And of Germany?")
    page.keyboard.press("Enter")
    wait_until(page, "document.querySelectorAll('.msg.assistant:not(.streaming) .inspect').length === 2", 180,
               "second answer")
    page.click(".msg.assistant >> nth=1 >> .inspect")
    cached = int(re.search(r"(\d+) from prefix cache", page.inner_text(".stat:nth-child(4) .stat-sub")).group(1))
    assert cached > 0
    assert page.locator("#inspector .chip.cached:not(.legend-chip)").count() == cached

    # The conversation, its answers and their traces survive a reload.
    page.reload()
    wait_until(page, "document.documentElement.dataset.ready === '1'", 30, "reloaded")
    assert page.locator(".conv-open").all_inner_texts() == ["What is the capital of France?"]
    assert page.locator(".msg.user").count() == 2 and page.locator(".msg.assistant").count() == 2
    assert page.inner_text(".msg.assistant .msg-body") == final
    page.click(".msg.assistant >> nth=0 >> .inspect")
    assert page.locator("#inspector .chip:not(.legend-chip)").count() == n_prompt
    assert errors == []


def test_stop_halts_generation_and_frees_the_request(server, browser):
    page, errors = open_page(browser, server, "web-test-stop", settings={"max_tokens": 400, "temperature": 0.8})
    page.click("#new-chat")
    page.fill("#prompt", "Write a long story about a dragon who learns to bake bread.")
    page.keyboard.press("Enter")
    wait_until(page, "(document.querySelector('.msg.assistant.streaming .msg-body')?.textContent.length || 0) > 20",
               120, "some streamed text")
    assert metric(server, "num_requests_running") == 1
    page.click("#stop")
    wait_until(page, "!document.querySelector('.streaming') && !!document.querySelector('.msg.assistant .badge')",
               10, "stopped")
    assert page.inner_text(".msg.assistant .badge") == "stopped"
    assert page.is_visible("#send") and not page.is_visible("#stop")

    # The server aborted the request: nothing running, and no more tokens are generated.
    deadline = time.monotonic() + 10
    while metric(server, "num_requests_running") != 0:
        assert time.monotonic() < deadline, "the engine still runs the stopped request"
        time.sleep(0.1)
    generated = metric(server, "generation_tokens_total")
    text = page.inner_text(".msg.assistant .msg-body")
    time.sleep(1.0)
    assert metric(server, "generation_tokens_total") == generated
    assert page.inner_text(".msg.assistant .msg-body") == text

    page.reload()
    wait_until(page, "document.documentElement.dataset.ready === '1'", 30, "reloaded")
    assert page.inner_text(".msg.assistant .badge") == "stopped"
    assert page.inner_text(".msg.assistant .msg-body") == text

    # Regenerate replaces the stopped answer in place (on the page and in the store).
    page.click(".msg.assistant .regenerate")
    wait_until(page, "(document.querySelector('.msg.assistant.streaming .msg-body')?.textContent.length || 0) > 5",
               120, "regenerated text")
    page.keyboard.press("Escape")  # Esc stops too
    wait_until(page, "!document.querySelector('.streaming')", 10, "stopped again")
    assert page.locator(".msg.assistant").count() == 1
    conv_id = page.evaluate("new URLSearchParams(location.hash.slice(1)).get('c')")
    stored = httpx.get(f"{server}/v1/kvserve/conversations/{conv_id}",
                       headers={"X-KVServe-Client": "web-test-stop"}).json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant"]
    # innerText drops trailing whitespace; output PII redaction releases text at word ends ("a ")
    assert stored[1]["content"].rstrip() == page.inner_text(".msg.assistant .msg-body")
    assert stored[1]["meta"]["stopped"] is True
    assert errors == []


EVIL = ("Look: <img src=x onerror=alert(1)> and <script>window.__pwned = 1; alert(2)</script>\n\n"
        "[click](javascript:alert(3)) **bold** <a href=\"javascript:alert(4)\">a</a>\n\n"
        "```html\n<img src=y onerror=alert(5)>\n```")


@pytest.mark.parametrize("bypass_csp", [False, True], ids=["with-csp", "renderer-alone"])
def test_untrusted_markup_renders_as_text_and_runs_nothing(server, browser, bypass_csp):
    trace = {"request_id": "chatcmpl-evil", "prompt_tokens": [{"id": 1, "text": "<img src=x onerror=alert(6)>",
                                                                "cached": False}],
             "timings_ms": {"ttft": 1.0, "total": 2.0},
             "output_tokens": [{"id": 2, "text": "<script>alert(7)</script>", "prob": 0.5,
                                "top": [{"id": 3, "text": "<img src=z onerror=alert(8)>", "prob": 0.5}]}]}
    client = f"web-test-evil-{bypass_csp:d}"
    conv = httpx.post(f"{server}/v1/kvserve/conversations", headers={"X-KVServe-Client": client},
                      json={"title": "<img src=t onerror=alert(9)>",
                            "messages": [{"role": "user", "content": "<script>alert(10)</script>"},
                                         {"role": "assistant", "content": EVIL, "trace": trace}]}).json()
    page, errors = open_page(browser, server, client, bypass_csp=bypass_csp, hash_=f"#c={conv['id']}")
    wait_until(page, "document.querySelectorAll('.msg').length === 2", 10, "stored messages")
    page.click(".msg.assistant .inspect")
    page.hover(".out-tok >> nth=0")

    body = page.inner_text(".msg.assistant .msg-body")
    assert "<img src=x onerror=alert(1)>" in body and "<script>window.__pwned = 1; alert(2)</script>" in body
    assert page.inner_text(".msg.user .msg-body") == "<script>alert(10)</script>"
    assert page.locator(".msg.assistant strong").inner_text() == "bold"
    assert page.locator(".msg.assistant pre code").inner_text() == "<img src=y onerror=alert(5)>"
    assert page.evaluate("""() => {
        const bad = document.querySelectorAll('#app img, #app script, #token-tooltip img, [onerror]');
        const hrefs = [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href'));
        return bad.length === 0 && hrefs.every(h => /^(https?:|mailto:)/.test(h)) && window.__pwned === undefined;
    }""")
    assert "<img src=x onerror=alert(6)>".replace(" ", "·") in page.inner_text("#inspector")
    assert page.locator(".conv-open").first.inner_text().startswith("<img")

    # The renderer on its own, in the page: only its own markup comes out.
    out = page.evaluate("""async (source) => {
        const {renderMarkdown} = await import('/static/markdown.js');
        const div = document.createElement('div');
        div.innerHTML = renderMarkdown(source);
        document.body.append(div);
        return {text: div.textContent, tags: [...div.querySelectorAll('*')].map(e => e.tagName.toLowerCase()),
                attrs: [...div.querySelectorAll('*')].flatMap(e => e.getAttributeNames()),
                hrefs: [...div.querySelectorAll('a')].map(a => a.getAttribute('href'))};
    }""", EVIL + "\n<svg onload=alert(11)>[x](https://ok.example/?a=\"b)")
    page.wait_for_timeout(200)
    assert set(out["tags"]) <= {"p", "strong", "em", "code", "pre", "a", "br"}, out["tags"]
    assert set(out["attrs"]) <= {"href", "target", "rel", "class", "data-lang"}, out["attrs"]
    assert out["hrefs"] == ['https://ok.example/?a="b']
    assert "[click](javascript:alert(3))" in out["text"] and "<svg onload=alert(11)>" in out["text"]
    assert errors == []


def test_phone_viewport_theme_and_keyboard(server, browser):
    client = "web-test-phone"
    conv = httpx.post(f"{server}/v1/kvserve/conversations", headers={"X-KVServe-Client": client},
                      json={"title": "Saved chat", "messages": [
                          {"role": "user", "content": "Show me code"},
                          {"role": "assistant", "content": "Sure:\n\n```python\nprint('hi')\n```\n\n- one\n- two"}]}).json()
    ctx = browser.new_context(viewport={"width": 390, "height": 800}, color_scheme="dark", is_mobile=True,
                              has_touch=True)
    ctx.add_init_script(f"localStorage.setItem('kvserve.clientId', {json.dumps(client)});")
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server}/#c={conv['id']}")
    wait_until(page, "document.documentElement.dataset.ready === '1'", 30, "page ready")

    # The sidebar is a drawer on a phone: off screen until the menu button opens it.
    assert not page.locator(".conv-open").first.is_visible() or page.evaluate(
        "document.getElementById('sidebar').getBoundingClientRect().right <= 0")
    page.click("#toggle-sidebar")
    wait_until(page, "document.getElementById('sidebar').getBoundingClientRect().left >= 0", 5, "drawer open")
    assert page.locator(".conv-open").all_inner_texts() == ["Saved chat"]
    page.keyboard.press("Escape")
    assert page.get_attribute("#toggle-sidebar", "aria-expanded") == "false"
    wait_until(page, "document.getElementById('sidebar').getBoundingClientRect().right <= 0", 5, "drawer closed")
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")  # nothing overflows sideways
    assert page.locator(".msg.assistant pre code").inner_text() == "print('hi')"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-chat-phone-dark.png"))

    # Theme toggle flips the system (dark) scheme to light, and it sticks across a reload.
    bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
    page.click("#toggle-sidebar")
    page.click("#theme-toggle")
    assert page.evaluate("document.documentElement.dataset.theme") == "light"
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") != bg
    page.reload()
    wait_until(page, "document.documentElement.dataset.ready === '1'", 30, "reloaded")
    assert page.evaluate("document.documentElement.dataset.theme") == "light"

    # Shift+Enter adds a line instead of sending; the composer is reachable from the keyboard.
    page.focus("#prompt")
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    assert page.input_value("#prompt") == "line one\nline two"
    assert page.locator(".msg").count() == 2
    assert errors == []


def test_reasoning_shows_collapsed_above_the_answer(server, browser):
    """"Think first" sends reasoning_effort; the <think> block streams into a collapsed Reasoning
    element above the answer, and stays there after a reload."""
    page, errors = open_page(browser, server, "web-test-reasoning",
                             settings={"max_tokens": 150, "temperature": 0, "reasoning": "low"})
    page.click("#new-chat")
    page.fill("#prompt", "Is 7 a prime number?")
    page.keyboard.press("Enter")
    wait_until(page, "!!document.querySelector('.msg.assistant:not(.streaming) .inspect')", 300, "answer done")
    details = page.locator(".msg.assistant details.reasoning")
    assert details.count() == 1 and details.is_visible() and details.get_attribute("open") is None
    thought = page.evaluate("document.querySelector('.msg.assistant .reasoning-body').textContent")
    assert thought.strip() and "think>" not in thought
    # the reasoning comes before the answer in the message
    assert page.evaluate("(() => { const m = document.querySelector('.msg.assistant');"
                         " return m.firstElementChild.matches('details.reasoning'); })()")
    page.click(".msg.assistant details.reasoning summary")
    assert page.is_visible(".msg.assistant .reasoning-body")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-chat-reasoning.png"))
    page.reload()
    wait_until(page, "document.documentElement.dataset.ready === '1'", 30, "reloaded")
    assert page.evaluate("document.querySelector('.msg.assistant .reasoning-body').textContent") == thought
    assert errors == []
