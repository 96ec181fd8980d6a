"""Grammars for tool calls in the Hermes/Qwen format that kvserve.server.stages.tools prompts for and
parses:  <tool_call>\\n{"name": "<one of the tools>", "arguments": <that tool's parameters>}\\n</tool_call>

- "named": the prompt already ends with `<tool_call>\\n{"name": "f", "arguments":` (the forcing
  prefix), so the grammar is the rest: the arguments under f's schema, then the closing.
- "required": the prompt ends with `<tool_call>\\n{"name": "`; the grammar picks one of the names,
  each followed by its own arguments schema; with parallel calls, more blocks may follow.
- "auto": free text until the model writes `<tool_call>` (a lazy lexeme: the trigger), then the
  block is constrained as above; text and further calls may follow.

Arguments schemas are checked like a response_format schema (errors name tools[i].function.parameters).
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.structured.grammar import JSON_OPTIONS, check_json_schema, tighten


def _lit(text: str) -> str:
    return json.dumps(text)          # a Lark string literal


def _args_schema(tool: dict[str, Any], i: int) -> dict[str, Any]:
    schema = tool["function"].get("parameters") or {"type": "object"}
    check_json_schema(schema, f"tools[{i}].function.parameters")
    return {**tighten(schema), "x-guidance": JSON_OPTIONS}


def tool_call_grammar(tools: list[dict[str, Any]], choice: str, forced_name: str | None, parallel: bool,
                      open_tag: str, close_tag: str) -> str | None:
    """A Lark grammar (llguidance dialect) for the answer of a request with tools, or None."""
    if choice == "none":
        return None
    index = {t["function"]["name"]: i for i, t in enumerate(tools)}
    end = "}\n" + close_tag
    rules = []
    if choice == "named":
        i = index[forced_name]
        rules.append(f"start: \" \" args_{i} {_lit(end)}")
        rules.append(f"args_{i}: %json {json.dumps(_args_schema(tools[i], i))}")
        return "\n".join(rules)
    names = sorted(index.items(), key=lambda kv: kv[1])
    alts = " | ".join(f"fn_{i}" for _, i in names)
    rules.append(f"call_rest: {alts}")
    for name, i in names:
        after_name = _lit(name + '", "arguments": ')
        rules.append(f"fn_{i}: {after_name} args_{i} {_lit(end)}")
        rules.append(f"args_{i}: %json {json.dumps(_args_schema(tools[i], i))}")
    head = f"{open_tag}\n{{\"name\": \""
    if choice == "required":
        more = f" (\"\\n\" {_lit(head)} call_rest)*" if parallel else ""
        rules.insert(0, f"start: call_rest{more}")
    else:   # auto: any text; `<tool_call>` triggers a constrained block
        rules.insert(0, "start: call* TEXT")
        rules.append("TEXT: /(.|\\n)*/")
        rules.append(f"call_hd[lazy]: TEXT {_lit(open_tag)}")
        rules.append(f"call: call_hd {_lit(head[len(open_tag):])} call_rest")
        if not parallel:
            rules[0] = "start: call? TEXT"
    return "\n".join(rules)
