"""Tool calling (OpenAI function calling) on /v1/chat/completions: prompt side and output side.

Prompt side. A chat template that reads a `tools` variable (Qwen2.5, Hermes, ...) gets the tool
definitions and the conversation in OpenAI's shape (tool-call arguments parsed into objects, as
transformers and vLLM pass them). Any other template (SmolLM2's, plain ChatML) gets them folded
into text in the Hermes/Qwen format: the function definitions and the call instruction are added
to the system prompt, an assistant turn's `tool_calls` become `<tool_call>` blocks in its content,
and each run of `tool` messages becomes one `user` turn of `<tool_response>` blocks (the role
every template accepts, as Qwen2.5's template does). `tool_choice` "required" and a named function
are forced by appending the opening of a call to the generation prompt (`forcing_prefix`).

Output side. `ToolCallParser` (`tool_parser.py`) turns generated text into content and calls. It
is incremental, so streaming and non-streaming answers go through the same code and agree: the
whole text is one `feed` for a JSON body, each engine delta is one `feed` for SSE.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvserve.server.stages.tool_parser import (  # noqa: F401  (ParsedCall, stream_delta: re-exported)
    CLOSE,
    OPEN,
    ParsedCall,
    ToolCallParser,
    new_call_id,
    stream_delta,
)

MAX_TOOLS = 128
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")

TOOLS_INSTRUCTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}}\n</tool_call>")


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

def parse_output(plan: ToolPlan, prefix: str, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of one finished choice. `prefix` is the forcing prefix the prompt ended
    with: the answer continues it, so it is put back in front before parsing. Content is None
    when there are calls and no other text."""
    parser = plan.parser()
    events = parser.feed(prefix + text) + parser.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    return (content or None) if parser.calls else content, parser.calls
