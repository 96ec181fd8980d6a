"""Tool calling, output side: generated text into content and calls, incrementally.

`ToolCallParser` is fed each engine delta (or a whole answer at once) and returns events; the
same code serves streaming and non-streaming answers, so they agree. Each feed costs what it
adds: the open block's end is found by a scanner that resumes where it stopped (`_EndScanner`),
the leading name is looked for in the block's first `_NAME_SCAN` characters only, and the whole
block is parsed once, when it closes. The prompt side and the request's plan are in `tools.py`.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_LEADING_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_ID_ALPHABET = string.ascii_letters + string.digits
_NAME_SCAN = 1024   # a block's leading name is looked for in its first characters only


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class ParsedCall:
    index: int
    id: str
    name: str
    arguments: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _JsonStrings:
    """Whether each character of a JSON text is inside a string, one character at a time, so a
    scan can stop at the end of what it has and resume when more comes (the quote and backslash
    state is all it carries)."""

    __slots__ = ("esc", "in_str")

    def __init__(self) -> None:
        self.in_str = self.esc = False

    def outside(self, ch: str) -> bool:
        """Take the next character; True when it is outside every string (quotes are neither)."""
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
            return False
        if ch == '"':
            self.in_str = True
            return False
        return True


class _EndScanner:
    """Where an open call block's body ends: at `</tool_call>` (or a new `<tool_call>`) outside
    JSON strings, or anywhere in a body that is not JSON. Incremental: the body only grows between
    calls, so the scan resumes where it stopped (in or out of a string) and each character is
    looked at once, plus a tag's length again when a tag is split across feeds. `examined` counts
    the characters looked at."""

    def __init__(self) -> None:
        self.pos = 0
        self.json: bool | None = None    # the body starts with "{" (None: only whitespace so far)
        self.strings = _JsonStrings()
        self.examined = 0

    def find(self, body: str) -> tuple[int, str] | None:
        """(index, tag) of the block's end in `body`, or None while it is still open."""
        n, k = len(body), self.pos
        if self.json is None:
            while k < n and body[k].isspace():
                k += 1
            self.examined += k - self.pos
            self.pos = k
            if k == n:
                return None
            self.json = body[k] == "{"
        if not self.json:
            hits = [(i, tag) for i, tag in ((body.find(CLOSE, k), CLOSE), (body.find(OPEN, k), OPEN)) if i >= 0]
            self.examined += n - k
            if hits:
                return min(hits)
            self.pos = max(k, n - len(CLOSE) + 1)     # a tag may be cut by the end of the body
            return None
        outside = self.strings.outside
        while k < n:
            if outside(body[k]) and body[k] == "<":     # "<" outside a string leaves the state as it was
                if body.startswith(CLOSE, k):
                    return k, CLOSE
                if body.startswith(OPEN, k):
                    return k, OPEN
                if n - k < len(CLOSE) and (CLOSE.startswith(body[k:]) or OPEN.startswith(body[k:])):
                    break                                # undecided until more text comes
            k += 1
        self.examined += k - self.pos
        self.pos = k
        return None


def _outside_strings(text: str):
    """(index, char) of every character of `text` that is not inside a JSON string (quotes included
    in neither)."""
    strings = _JsonStrings()
    for k, ch in enumerate(text):
        if strings.outside(ch):
            yield k, ch


def _brace_balance(text: str) -> int:
    depth = 0
    for _, ch in _outside_strings(text):
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return depth


def _decode_name(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


def parse_block(body: str) -> tuple[str | None, str]:
    """(name, arguments JSON string) of one block's body. Arguments that are not valid JSON come
    back as their raw text, as OpenAI allows; a missing `arguments` key is `{}`."""
    m = _LEADING_NAME.match(body)
    name = _decode_name(m.group(1)) if m else None
    s = body.strip()
    try:
        obj, _ = json.JSONDecoder().raw_decode(s)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        if name is None and isinstance(obj.get("name"), str):
            name = obj["name"]
        args = obj.get("arguments", obj.get("parameters", {}))
        return name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    k = _ARGS_KEY.search(s)
    if k is None:
        return name, ""
    raw = s[k.end():].rstrip()
    if raw.endswith("}") and _brace_balance(raw) < 0:
        raw = raw[:-1].rstrip()   # the brace closing the outer {"name", "arguments"} object
    try:
        return name, json.dumps(json.loads(raw), ensure_ascii=False)
    except ValueError:
        return name, raw


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that could be the start of `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


@dataclass
class ToolCallParser:
    """Incremental `<tool_call>` extraction for one choice.

    `feed(text)` and `finish()` return events: ("content", text), ("call", ParsedCall) when a
    call's name is known (its id/type/name can be sent), ("arguments", ParsedCall) when its
    arguments are complete. Text that may be the start of a tag is held back until it is known;
    whitespace next to a call block is not content. A block naming a function not in `names` (or
    without a readable name) is released as content, tags included; with `parallel=False` only
    the first call is kept and later ones are dropped."""

    names: frozenset[str]
    parallel: bool = True
    calls: list[ParsedCall] = field(default_factory=list)
    _text: str = ""
    _block: str | None = None          # body of the open block, None outside one
    _block_ws: str = ""                # whitespace before the open block (content if it is released)
    _scan: _EndScanner = field(default_factory=_EndScanner)   # where the open block's scan stopped
    _current: ParsedCall | None = None  # the open block's call, once its name was announced
    _surplus: bool = False             # the open block is a call beyond the first (parallel=False)
    _after_call: bool = False          # drop whitespace right after a call block
    _said: bool = False                # some content was emitted

    def feed(self, text: str) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        if self._block is None:
            self._text += text
        else:
            self._block += text
        while self._step_block(events) if self._block is not None else self._step_text(events):
            pass
        return events

    def finish(self) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        if self._block is not None:
            self._close(self._block, closed=False, events=events)
        rest, self._text = self._text, ""
        if self.calls:
            rest = rest.rstrip()
            if self._after_call:
                rest = rest.lstrip()
        if rest:
            events.append(("content", rest))
        return events

    # ---- internals ----------------------------------------------------------------------------
    def _step_text(self, events: list) -> bool:
        t, lead = self._text, ""
        if self._after_call:
            t = t.lstrip()
            if not t:
                self._text = ""
                return False
            # Text resuming after a call keeps the whitespace that separated it from earlier text.
            lead = (self._text[:len(self._text) - len(t)] or "\n") if self._said else ""
        i = t.find(OPEN)
        if i >= 0:
            before = t[:i]
            kept = before.rstrip()
            self._say(lead, kept, events)
            self._block_ws, self._text, self._block = before[len(kept):], "", t[i + len(OPEN):]
            self._scan = _EndScanner()
            return True
        head = t[:len(t) - _partial_open(t)]
        kept = head.rstrip()
        self._say(lead, kept, events)
        self._text = t[len(kept):] if kept or not lead else lead + t
        return False

    def _say(self, lead: str, text: str, events: list) -> None:
        if text:
            events.append(("content", lead + text))
            self._said, self._after_call = True, False

    def _step_block(self, events: list) -> bool:
        body = self._block
        assert body is not None
        if self._current is None and not self._surplus:
            m = _LEADING_NAME.match(body[:_NAME_SCAN])    # a name this far in is not a tool's
            if m:
                name = _decode_name(m.group(1))
                if name not in self.names:
                    self._release(body, closed=False, events=events)
                    return True
                if not self.parallel and self.calls:
                    self._surplus = True
                else:
                    self._current = self._new_call(name, events)
        end = self._scan.find(body)
        if end is None:
            return False
        k, tag = end
        self._close(body[:k], closed=tag == CLOSE, events=events)
        self._text += body[k + len(CLOSE):] if tag == CLOSE else body[k:]
        return True

    def _new_call(self, name: str, events: list) -> ParsedCall:
        call = ParsedCall(len(self.calls), new_call_id(), name)
        self.calls.append(call)
        events.append(("call", call))
        return call

    def _close(self, body: str, *, closed: bool, events: list) -> None:
        """End the open block: a call (arguments event), a dropped surplus call, or content."""
        name, args = parse_block(body)
        call = self._current
        if call is None and not self._surplus and name in self.names:
            if not self.parallel and self.calls:
                self._surplus = True
            else:
                call = self._new_call(name, events)
        if call is not None:
            call.arguments = args
            events.append(("arguments", call))
        elif not self._surplus:
            self._release(body, closed=closed, events=events)
            return
        self._block, self._current, self._surplus, self._after_call = None, None, False, True
        self._block_ws = ""

    def _release(self, body: str, *, closed: bool, events: list) -> None:
        """The open block is not a call: its text (from the tag on) goes back to the text stream."""
        events.append(("content", self._block_ws + OPEN))
        self._said, self._after_call = True, False
        self._block, self._block_ws = None, ""
        self._text = body + (CLOSE if closed else "")


def stream_delta(events: list[tuple[str, Any]]) -> dict[str, Any]:
    """An SSE `delta` in OpenAI's shape for parser events: content text and/or `tool_calls`
    entries (id, type and name in a call's first entry, its arguments in a later one)."""
    delta: dict[str, Any] = {}
    text = "".join(e[1] for e in events if e[0] == "content")
    if text:
        delta["content"] = text
    entries: dict[int, dict[str, Any]] = {}
    for kind, call in events:
        if kind == "call":
            entries[call.index] = {"index": call.index, "id": call.id, "type": "function",
                                   "function": {"name": call.name, "arguments": ""}}
        elif kind == "arguments":
            entry = entries.setdefault(call.index, {"index": call.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] = call.arguments
    if entries:
        delta["tool_calls"] = list(entries.values())
    return delta
