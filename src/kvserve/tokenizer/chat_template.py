"""Chat templates: the model's Jinja template rendered in a sandbox, as transformers does.

Templates come from model files, so they are untrusted code: `ImmutableSandboxedEnvironment`
forbids attribute tricks and mutation of the passed data. Message content given as a list of
text parts (OpenAI's `[{"type": "text", "text": ...}]`) is joined into one string first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvserve.errors import InvalidRequest

# ChatML, used when a model ships no template.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")


def _raise(msg: str):
    raise InvalidRequest(f"chat template error: {msg}", param="messages")


@lru_cache(maxsize=1)
def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=16)
def _compile(template: str):
    return _env().from_string(template)


@lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from its context (e.g. "tools" for tool-aware templates)."""
    try:
        return frozenset(meta.find_undeclared_variables(_env().parse(template)))
    except TemplateError:
        return frozenset()   # rendering will report the error


def flatten_content(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") in ("text", "input_text"):
                parts.append(str(p.get("text", "")))
            elif isinstance(p, str):
                parts.append(p)
            else:
                raise InvalidRequest("only text content parts are supported", param="messages")
        return "".join(parts)
    raise InvalidRequest("message content must be a string or a list of text parts", param="messages")


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         tools: list[dict] | None = None, **kwargs) -> str:
    """Render `messages`; `tools` (OpenAI tool definitions) is passed as the template's `tools`
    variable, as transformers does; templates that do not read it ignore it."""
    msgs = [{**m, "content": flatten_content(m.get("content"))} for m in messages]
    try:
        return _compile(template).render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **kwargs)
    except InvalidRequest:
        raise
    except TemplateError as e:
        raise InvalidRequest(f"the model's chat template failed to render: {e}", param="messages") from None


@dataclass
class FittedChat:
    text: str
    token_ids: list[int]
    dropped_messages: int   # oldest non-system messages removed to fit
    fits: bool


def fit_chat(tokenizer, messages: list[dict], budget: int, *, drop_oldest: bool = True,
             add_generation_prompt: bool = True, tools: list[dict] | None = None, suffix: str = "") -> FittedChat:
    """Render and tokenize a conversation to at most `budget` tokens. With `drop_oldest`, the oldest
    non-system messages go one at a time until it fits; the system prompt(s) and the last message
    always stay. `suffix` is text appended after the rendered template (a forced answer opening).
    The caller decides what to say when it still does not fit (`fits` is False)."""
    msgs = list(messages)

    def render() -> tuple[str, list[int]]:
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tools=tools)
        text += suffix
        return text, tokenizer.encode(text, add_special_tokens=False)

    text, ids = render()
    dropped = 0
    while len(ids) > budget and drop_oldest:
        victim = next((i for i, m in enumerate(msgs[:-1]) if m["role"] != "system"), None)
        if victim is None:
            break
        del msgs[victim]
        dropped += 1
        text, ids = render()
    return FittedChat(text, ids, dropped, len(ids) <= budget)
