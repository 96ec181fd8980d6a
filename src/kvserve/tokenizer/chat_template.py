"""Chat templates: the model's Jinja template rendered in a sandbox, as transformers does.

Templates come from model files, so they are untrusted code: `ImmutableSandboxedEnvironment`
forbids attribute tricks and mutation of the passed data, and `_LimitedEnv` bounds what a render
may cost: `*` and `**` may not build values past the output cap (`{{ 'a' * 10**9 }}`), the output
is produced piece by piece and stops past `MAX_RENDER_CHARS`, and every call, operator and piece
checks a deadline of `RENDER_TIMEOUT_S`. Past either limit the request gets a 400. Message content given as a list of
text parts (OpenAI's `[{"type": "text", "text": ...}]`) is joined into one string first.
"""

from __future__ import annotations

import json
import threading
import time
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

# A GGUF with a SentencePiece vocabulary and no `tokenizer.chat_template` (a base model, or a
# file whose converter dropped it): no chat markup the model never saw, and no ChatML tokens its
# vocabulary lacks. The messages' texts, one paragraph each, after BOS: raw completion.
RAW_COMPLETION_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
    "{% if not loop.last %}{{ '\n\n' }}{% endif %}{% endfor %}")


def _raise(msg: str):
    raise InvalidRequest(f"chat template error: {msg}", param="messages")


MAX_RENDER_CHARS = 4_000_000   # a rendered prompt (the request body is capped at 1 MB)
RENDER_TIMEOUT_S = 5.0
_deadline = threading.local()


def _check_deadline() -> None:
    end = getattr(_deadline, "at", None)
    if end is not None and time.monotonic() > end:
        raise InvalidRequest(f"The model's chat template took more than {RENDER_TIMEOUT_S:g} s to render; "
                             "shorten the messages.", param="messages")


class _LimitedEnv(ImmutableSandboxedEnvironment):
    """The sandbox plus a size check on `*` / `**` and a deadline on every call and operator."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context, operator: str, left, right):
        _check_deadline()
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 256:
            raise InvalidRequest("The model's chat template computes too large a power.", param="messages")
        if operator == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
            left, right = right, left
        if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int) \
                and len(left) * right > MAX_RENDER_CHARS:
            raise InvalidRequest(f"The model's chat template builds a value longer than {MAX_RENDER_CHARS} "
                                 "characters.", param="messages")
        return super().call_binop(context, operator, left, right)

    def call(self, context, obj, /, *args, **kwargs):
        _check_deadline()
        return super().call(context, obj, *args, **kwargs)


@lru_cache(maxsize=1)
def _env() -> ImmutableSandboxedEnvironment:
    env = _LimitedEnv(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
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
    _deadline.at = time.monotonic() + RENDER_TIMEOUT_S
    try:
        parts, size = [], 0
        for piece in _compile(template).generate(messages=msgs, add_generation_prompt=add_generation_prompt,
                                                 tools=tools, **kwargs):
            size += len(piece)
            if size > MAX_RENDER_CHARS:
                raise InvalidRequest(f"The model's chat template produced more than {MAX_RENDER_CHARS} "
                                     "characters; shorten the messages.", param="messages")
            _check_deadline()
            parts.append(piece)
        return "".join(parts)
    except InvalidRequest:
        raise
    except (TemplateError, MemoryError, OverflowError, RecursionError) as e:
        raise InvalidRequest(f"the model's chat template failed to render: {e}", param="messages") from None
    finally:
        _deadline.at = None


@dataclass
class FittedChat:
    text: str
    token_ids: list[int]
    dropped_messages: int   # oldest non-system messages removed to fit
    fits: bool


def fit_chat(tokenizer, messages: list[dict], budget: int, *, drop_oldest: bool = True,
             add_generation_prompt: bool = True, tools: list[dict] | None = None, suffix: str = "") -> FittedChat:
    """Render and tokenize a conversation to at most `budget` tokens. With `drop_oldest`, the fewest
    oldest non-system messages are dropped that make it fit; the system prompt(s) and the last
    message always stay. `suffix` is text appended after the rendered template (a forced answer
    opening). The caller decides what to say when it still does not fit (`fits` is False).

    How many to drop is found by bisection (dropping more never makes the prompt longer), so a
    conversation of M messages costs O(log M) renders, not one per dropped message."""
    droppable = [i for i, m in enumerate(messages[:-1]) if m["role"] != "system"]
    renders: dict[int, tuple[str, list[int]]] = {}

    def render(k: int) -> tuple[str, list[int]]:
        """The conversation without its k oldest droppable messages."""
        if k not in renders:
            gone = set(droppable[:k])
            msgs = [m for i, m in enumerate(messages) if i not in gone]
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tools=tools)
            text += suffix
            renders[k] = text, tokenizer.encode(text, add_special_tokens=False)
        return renders[k]

    def fits(k: int) -> bool:
        return len(render(k)[1]) <= budget

    lo, hi = 0, len(droppable)          # lo: the most known not to fit; hi: the fewest that may
    if fits(0) or not drop_oldest or not droppable or not fits(hi):
        k = 0 if fits(0) or not drop_oldest else hi
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        k = hi
    text, ids = render(k)
    return FittedChat(text, ids, k, len(ids) <= budget)
