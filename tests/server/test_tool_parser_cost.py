"""The tool-call parser's open block is scanned once, not once per token: the same block ends
as the full rescan found, and a long block fed a character at a time looks at each character
a bounded number of times."""

from __future__ import annotations

import random

import pytest

from kvserve.server.stages.tool_parser import CLOSE, OPEN, ToolCallParser, _EndScanner


def rescan_end(body: str) -> tuple[int, str] | None:
    """The full rescan the scanner replaced."""
    if not body.lstrip().startswith("{"):
        i, j = body.find(CLOSE), body.find(OPEN)
        hits = [(k, tag) for k, tag in ((i, CLOSE), (j, OPEN)) if k >= 0]
        return min(hits) if hits else None
    in_str = esc = False
    for k, ch in enumerate(body):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch == "<":
            if body.startswith(CLOSE, k):
                return k, CLOSE
            if body.startswith(OPEN, k):
                return k, OPEN
    return None


PIECES = ['{', '}', '"', '\\', ' ', '\n', 'a', '<', '/', 'tool_call', '>', '</tool_call>', '<tool_call>',
          '"name"', ': ', '"f"', '</tool', '_call>', '<tool_', 'call>']


@pytest.mark.parametrize("seed", range(300))
def test_the_scanner_finds_the_same_end_as_a_rescan(seed):
    rng = random.Random(seed)
    body, scan = "", _EndScanner()
    for _ in range(rng.randint(1, 40)):
        body += "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 3)))
        got, want = scan.find(body), rescan_end(body)
        assert got == want, repr(body)
        if got is not None:
            break


def events_text(events) -> list:
    return [(k, v if k == "content" else (v.name, v.arguments)) for k, v in events]


@pytest.mark.parametrize("seed", range(100))
def test_streamed_and_whole_answers_agree(seed):
    rng = random.Random(seed)
    parts = ["hello ", OPEN, '\n{"name": "f", "arguments": {"q": "a<b \\" </tool_call> x"}}\n', CLOSE,
             " then ", OPEN, '{"name": "g", "arguments": {}}', CLOSE, " bye", OPEN, "not json", CLOSE]
    text = "".join(rng.sample(parts, len(parts)))
    whole = ToolCallParser(frozenset({"f", "g"}))
    want = whole.feed(text) + whole.finish()
    streamed = ToolCallParser(frozenset({"f", "g"}))
    got, i = [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        got += streamed.feed(text[i:i + n])
        i += n
    got += streamed.finish()
    content = "".join(v for k, v in got if k == "content")
    assert content == "".join(v for k, v in want if k == "content")
    assert [(c.name, c.arguments) for c in streamed.calls] == [(c.name, c.arguments) for c in whole.calls]


@pytest.mark.parametrize("body", ['{"name": "f", "arguments": {"text": "' + "a<\\\"" * 20_000,
                                  "plain " * 20_000])
def test_a_long_open_block_is_scanned_once(body):
    parser = ToolCallParser(frozenset({"f"}))
    parser.feed(OPEN)
    for ch in body:
        parser.feed(ch)
    # once each (a JSON body), or at most a closing tag's length again per feed (plain text)
    assert parser._scan.examined <= (1 if body.startswith("{") else len(CLOSE)) * (len(body) + 1)
    events = parser.feed('"}}' + CLOSE if body.startswith("{") else CLOSE) + parser.finish()
    if body.startswith("{"):
        assert [c.name for c in parser.calls] == ["f"] and len(parser.calls[0].arguments) > len(body) // 2
    else:
        assert "".join(v for k, v in events if k == "content").startswith(OPEN + "plain plain")
