"""Tool calling (OpenAI function calling) on /v1/chat/completions: prompt side and output side.

Prompt side. A chat template that reads a `tools` variable (Qwen2.5, Hermes, ...) gets the tool
definitions and the conversation in OpenAI's shape (tool-call arguments parsed into objects, as
transformers and vLLM pass them). Any other template (SmolLM2's, plain ChatML) gets them folded
into text in the Hermes/Qwen format: the function definitions and the call instruction are added
to the system prompt, an assistant turn's `tool_calls` become `<tool_call>` blocks in its content,
and each run of `tool` messages becomes one `user` turn of `<tool_response>` blocks (the role
every template accepts, as Qwen2.5's template does). `tool_choice` "required" and a named function
are forced by appending the opening of a call to the generation prompt (`forcing_prefix`).

Output side. `ToolCallParser` turns generated text into content and calls. It is incremental,
so streaming and non-streaming answers go through the same code and agree: the whole text is
one `feed` for a JSON body, each engine delta is one `feed` for SSE.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_LEADING_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_ID_ALPHABET = string.ascii_letters + string.digits

TOOLS_INSTRUCTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}}\n</tool_call>")


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


# ---- what a request asks for ------------------------------------------------------------------

@dataclass(frozen=True)
class ToolPlan:
    """The tools of one request and how they are used.

    `choice` is "none" (tools neither shown nor parsed), "auto", "required" or "named"
    (`forced_name`). "required" with a single tool is the same as naming it."""

    tools: list[dict[str, Any]]
    choice: str
    forced_name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.choice != "none"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def forcing_prefix(self) -> str:
        """Text appended after the generation prompt so the model continues inside a call."""
        if self.choice == "named":
            # No space after the colon: SmolLM2/GPT-2 style BPE has ' {"' as one token, and a prompt
            # ending in a bare space steers small models away from writing the object.
            return f"{OPEN}\n{{\"name\": {json.dumps(self.forced_name)}, \"arguments\":"
        if self.choice == "required":
            return f"{OPEN}\n{{\"name\": \""
        return ""

    @property
    def stop(self) -> list[str]:
        """Internal stop strings: a single call ends the answer when only one call is wanted."""
        return [CLOSE] if self.active and (self.choice == "named" or not self.parallel) else []

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.names, parallel=self.parallel and self.choice != "named")


def make_plan(tools: list | None, tool_choice: str | dict | None,
              parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The plan for a validated request (tools as protocol models or dicts); None without tools."""
    if not tools:
        return None
    tools = [t if isinstance(t, dict) else t.model_dump(exclude_none=True) for t in tools]
    parallel = parallel_tool_calls is not False
    if isinstance(tool_choice, dict):
        return ToolPlan(tools, "named", tool_choice["function"]["name"], parallel)
    choice = tool_choice or "auto"
    if choice == "required" and len(tools) == 1:
        return ToolPlan(tools, "named", tools[0]["function"]["name"], parallel)
    return ToolPlan(tools, choice, None, parallel)


# ---- prompt side ----------------------------------------------------------------------------

def _arguments_value(arguments: Any) -> Any:
    """A call's arguments as an object where they are JSON, else the raw string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _call_block(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = _arguments_value(fn.get("arguments", {}))
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f"{OPEN}\n{{\"name\": {json.dumps(fn.get('name', ''), ensure_ascii=False)}, \"arguments\": {args_text}}}\n{CLOSE}"


def tools_system_text(plan: ToolPlan) -> str:
    text = TOOLS_INSTRUCTION.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools))
    if not plan.parallel:
        text += "\nCall at most one function."
    return text


def fold_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool messages as plain text turns, for templates that know nothing of tools."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            content = m.get("content") or ""
            blocks = "\n".join(_call_block(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content.strip()}\n{blocks}" if content.strip()
                        else blocks})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_responses"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_responses": True})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    return [{k: v for k, v in m.items() if k != "_tool_responses"} for m in out]


def native_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages for a template with tool support: arguments as objects (as vLLM passes)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": _arguments_value(c["function"]["arguments"])}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def add_tools_to_system(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    text = tools_system_text(plan)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        sys = (first.get("content") or "").rstrip()
        return [{**first, "content": f"{sys}\n\n{text}" if sys else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ---- output side ----------------------------------------------------------------------------

@dataclass
class ParsedCall:
    index: int
    id: str
    name: str
    arguments: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _find_end(body: str) -> tuple[int, str] | None:
    """Where a call block's body ends: at `</tool_call>` (or a new `<tool_call>`) outside JSON
    strings. None while the block is still open."""
    if not body.lstrip().startswith("{"):
        i, j = body.find(CLOSE), body.find(OPEN)
        hits = [(k, tag) for k, tag in ((i, CLOSE), (j, OPEN)) if k >= 0]
        return min(hits) if hits else None
    for k, ch in _outside_strings(body):
        if ch == "<":
            if body.startswith(CLOSE, k):
                return k, CLOSE
            if body.startswith(OPEN, k):
                return k, OPEN
    return None


def _outside_strings(text: str):
    """(index, char) of every character of `text` that is not inside a JSON string (quotes included
    in neither)."""
    in_str = esc = False
    for k, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        else:
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
            m = _LEADING_NAME.match(body)
            if m:
                name = _decode_name(m.group(1))
                if name not in self.names:
                    self._release(body, closed=False, events=events)
                    return True
                if not self.parallel and self.calls:
                    self._surplus = True
                else:
                    self._current = self._new_call(name, events)
        end = _find_end(body)
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


def parse_output(plan: ToolPlan, prefix: str, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of one finished choice. `prefix` is the forcing prefix the prompt ended
    with: the answer continues it, so it is put back in front before parsing. Content is None
    when there are calls and no other text."""
    parser = plan.parser()
    events = parser.feed(prefix + text) + parser.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    return (content or None) if parser.calls else content, parser.calls


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
