"""Build the engine's input from a request: render the chat template, tokenize, fit the window.

Everything here is CPU work (Jinja rendering, BPE), so the server calls it through
`asyncio.to_thread` and the event loop keeps streaming other requests meanwhile.

With `truncate: "oldest"` a conversation that does not fit loses its oldest non-system turns,
one at a time, until prompt + max_tokens fits; the system prompt(s) and the last message are
always kept. Without it, a prompt that does not fit is a 400 `context_length_exceeded`. What was
dropped is in the prompt (`dropped_messages`) and in `kvserve_trace.context`.

Before any rendering or tokenizing, a cheap bound turns away what can never fit: a text of C
characters is at least C / (SLACK x the longest token's length) tokens, so a 0.5 MB chat for a
512-token window is refused (or, with truncation, loses the turns that alone overflow) after a
length count, not after tokenizing 275k tokens (issue 60: 1 s of a core per hostile request).

The conversation itself is assembled here too, for every API that has one: chat completions send
it whole; the Responses API (server/api/responses.py) builds it with `conversation()`: the
instructions as the system prompt, the stored history of `previous_response_id`
(server/stores/responses.py), the new input items, and tool outputs as `tool` turns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import ContextLengthExceeded, InvalidRequest
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from kvserve.server.stages.reasoning import EFFORT_BUDGETS
from kvserve.server.stages.tools import ToolPlan, add_tools_to_system, fold_history, native_history
from kvserve.tokenizer.chat_template import fit_chat


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None
    dropped_messages: int = 0
    forced_prefix: str = ""   # text after the generation prompt that the answer continues (tools)
    notes: list[str] = field(default_factory=list)


def _item_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                raise InvalidRequest("Content parts must be {\"type\": \"input_text\", \"text\": ...} (images and "
                                     "files are not supported).", param=f"{param}.content[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest("content must be a string or a list of input_text parts.", param=f"{param}.content")


def conversation(instructions: str | None, history: list[dict[str, Any]],
                 items: str | list[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the whole context as chat messages, the new turns alone) for a Responses request: system
    prompt from `instructions`, then the stored history, then the input items (messages, earlier
    `function_call`s, `function_call_output`s as tool turns)."""
    new: list[dict[str, Any]] = []
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest("Each input item must be an object.", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest("role must be user, system, developer or assistant.", param=f"{param}.role")
            new.append({"role": role, "content": _item_text(item.get("content"), param)})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if not isinstance(call["function"]["name"], str) or not isinstance(call["id"], str):
                raise InvalidRequest("A function_call item needs call_id and name.", param=param)
            if new and new[-1]["role"] == "assistant" and new[-1].get("tool_calls") is not None:
                new[-1]["tool_calls"].append(call)
            else:
                new.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(out, str):
                raise InvalidRequest("A function_call_output item needs call_id and a string output.", param=param)
            new.append({"role": "tool", "tool_call_id": item["call_id"], "content": out})
        else:
            raise InvalidRequest(f"Input items of type {kind!r} are not supported (message, function_call, "
                                 "function_call_output are).", param=f"{param}.type")
    system = [{"role": "system", "content": instructions}] if instructions else []
    return system + list(history) + new, new


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as the dicts chat templates take, tool turns in OpenAI's shape."""
    out = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        d: dict[str, Any] = {"role": role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name and role == "tool":
            d["name"] = m.name
        out.append(d)
    return out


def template_messages(tokenizer, messages: list[ChatMessage],
                      plan: ToolPlan | None) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """(messages, tools) to render: the tools go to a template that reads them, or into the
    system prompt of one that does not, whose tool turns are folded into text (tools.py)."""
    msgs = message_dicts(messages)
    native = tokenizer.supports_tools
    msgs = native_history(msgs) if native else fold_history(msgs)
    if plan is None or not plan.active:
        return msgs, None
    if native:
        return msgs, plan.tools
    return add_tools_to_system(msgs, plan), None


def build_chat_prompt(tokenizer, messages: list[ChatMessage], *, max_model_len: int,
                      max_tokens: int | None, truncate: str | None,
                      add_generation_prompt: bool = True, tools: ToolPlan | None = None,
                      think: bool = False) -> Prompt:
    """Render and tokenize a conversation so that prompt + max_tokens (or + 1) fits the window.

    With a tool plan the tools are rendered (unless tool_choice is "none") and a forced
    tool_choice appends the opening of a call after the generation prompt."""
    msgs, tool_defs = template_messages(tokenizer, messages, tools)
    suffix = tools.forcing_prefix if tools is not None and add_generation_prompt else ""
    if think and add_generation_prompt:    # the answer starts inside a <think> block (server/stages/reasoning.py)
        suffix = "<think>\n" + suffix
    return fit_messages(tokenizer, msgs, max_model_len=max_model_len, max_tokens=max_tokens, truncate=truncate,
                        add_generation_prompt=add_generation_prompt, tools=tool_defs, suffix=suffix)


SLACK = 4     # normalizers may fold characters (NFKC): the bound stays below the true count by this much


@functools.lru_cache(maxsize=16)
def longest_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry, added
    and special tokens included: a byte-level entry has one character per byte it covers)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return 0
    return max((len(t) for t in hf.get_vocab(with_added_tokens=True)), default=0)


def min_tokens(tokenizer, msgs: list[dict[str, Any]]) -> int:
    """A lower bound on the tokens `msgs` render to, from their lengths alone (0: no bound known)."""
    longest = longest_token_chars(tokenizer)
    if not longest:
        return 0
    chars = sum(len(m["content"]) for m in msgs if isinstance(m.get("content"), str))
    return chars // (SLACK * longest)


def _drop_by_bound(tokenizer, msgs: list[dict[str, Any]], budget: int,
                   drop_oldest: bool) -> tuple[list[dict[str, Any]], int, int]:
    """(the messages left, how many were dropped, their lower bound) after dropping, with
    `drop_oldest`, the oldest non-system turns (never the last message) while the rest's lower
    bound alone is over `budget`; counts characters only."""
    bound = min_tokens(tokenizer, msgs)
    if bound <= budget or not drop_oldest:
        return msgs, 0, bound
    droppable = [i for i, m in enumerate(msgs[:-1]) if m["role"] != "system"]
    longest = longest_token_chars(tokenizer)
    chars = sum(len(m["content"]) for m in msgs if isinstance(m.get("content"), str))
    k = 0
    while k < len(droppable) and chars // (SLACK * longest) > budget:
        content = msgs[droppable[k]].get("content")
        chars -= len(content) if isinstance(content, str) else 0
        k += 1
    gone = set(droppable[:k])
    return [m for i, m in enumerate(msgs) if i not in gone], k, chars // (SLACK * longest)


def refuse_by_length(tokenizer, req: ChatCompletionRequest | CompletionRequest, max_model_len: int) -> None:
    """400 `context_length_exceeded` for a request whose text alone (the messages that
    `truncate: "oldest"` would keep; each string prompt) cannot fit the window by the length bound:
    the plan calls it before input moderation's scan when the model is resident, so a 0.5 MB chat
    costs a length count, not a PII scan and a tokenization."""
    reserve = req.requested_max_tokens() or 1
    if isinstance(req, ChatCompletionRequest):
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        if req.truncate == "oldest" and msgs:
            msgs = [m for m in msgs[:-1] if m["role"] in ("system", "developer")] + msgs[-1:]
        texts, param = [msgs], "messages"
    else:
        texts = [[{"content": req.prompt}]] if isinstance(req.prompt, str) else \
            [[{"content": t}] for t in req.prompt if isinstance(t, str)]
        param = "prompt"
    for group in texts:
        bound = min_tokens(tokenizer, group)
        if bound + reserve > max_model_len:
            raise ContextLengthExceeded(f"This model's maximum context length is {max_model_len} tokens, but the "
                                        f"request needs at least {bound} prompt tokens + {reserve} max_tokens. "
                                        f"Shorten the {param} or lower max_tokens.", param=param)


def fit_messages(tokenizer, msgs: list[dict[str, Any]], *, max_model_len: int, max_tokens: int | None,
                 truncate: str | None, add_generation_prompt: bool = True, tools: list[dict] | None = None,
                 suffix: str = "") -> Prompt:
    """Render and tokenize chat-template messages (dicts) so that prompt + max_tokens (or + 1)
    fits: the one place a conversation is fitted to the window (chat completions, Responses and
    `kvserve chat` all end here). `truncate="oldest"` drops the oldest non-system turns."""
    reserve = max_tokens if max_tokens is not None else 1
    budget = max_model_len - reserve
    hint = ("shorten the messages or lower max_tokens" if truncate == "oldest" else
            'shorten the messages, lower max_tokens, or send "truncate": "oldest" to drop old turns')
    extra = f" + max_tokens {max_tokens}" if max_tokens else ""
    msgs, predropped, bound = _drop_by_bound(tokenizer, msgs, budget, truncate == "oldest")
    if bound > budget:      # refused on its length alone: nothing rendered or tokenized
        raise ContextLengthExceeded(f"This model's maximum context length is {max_model_len} tokens, but "
                                    f"the request needs at least {bound} prompt tokens{extra}. Please {hint}.",
                                    param="messages")
    # The tokenizer's sandboxed template raises InvalidRequest(param="messages") itself.
    fitted = fit_chat(tokenizer, msgs, budget, drop_oldest=truncate == "oldest",
                      add_generation_prompt=add_generation_prompt, tools=tools, suffix=suffix)
    text, ids, dropped = fitted.text, fitted.token_ids, fitted.dropped_messages + predropped
    if not fitted.fits:
        raise ContextLengthExceeded(f"This model's maximum context length is {max_model_len} tokens, but "
                                    f"the request needs {len(ids)} prompt tokens{extra}. Please {hint}.",
                                    param="messages")
    return Prompt(token_ids=ids, text=text, dropped_messages=dropped, forced_prefix=suffix)


def build_completion_prompts(tokenizer, prompt: str | list, *, vocab_size: int | None) -> list[Prompt]:
    """One Prompt per entry of a completions `prompt` (string, strings, token ids, or lists of ids)."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=True)
            out.append(Prompt(token_ids=ids, text=item))
        else:
            if not item:
                raise InvalidRequest("A token-id prompt must not be empty.", param=f"prompt[{i}]")
            bad = next((t for t in item if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
            if bad is not None:
                raise InvalidRequest(f"Token id {bad} is outside the vocabulary (0..{(vocab_size or 0) - 1}).",
                                     param="prompt")
            out.append(Prompt(token_ids=list(item), text=None))
        if not out[-1].token_ids:
            raise InvalidRequest("The prompt is empty after tokenization; send some text.", param="prompt")
    return out


def build_prompts(tokenizer, req: ChatCompletionRequest | CompletionRequest, *, max_model_len: int,
                  max_tokens: int | None, tools: ToolPlan | None = None) -> list[Prompt]:
    """The engine's prompts for a validated request: one for chat, one per entry for completions;
    raises ContextLengthExceeded when a prompt + max_tokens does not fit the window."""
    if isinstance(req, ChatCompletionRequest):
        return [build_chat_prompt(tokenizer, req.messages, max_model_len=max_model_len, max_tokens=max_tokens,
                                  truncate=req.truncate, add_generation_prompt=req.add_generation_prompt,
                                  tools=tools, think=reasoning_budget(req) is not None)]
    texts = [req.prompt] if isinstance(req.prompt, str) else [t for t in req.prompt if isinstance(t, str)]
    for text in texts:      # refused on its length alone, before tokenizing (see the module docstring)
        bound = min_tokens(tokenizer, [{"content": text}])
        if bound + (max_tokens or 1) > max_model_len:
            raise ContextLengthExceeded(f"This model's maximum context length is {max_model_len} tokens, but the "
                                        f"request needs at least {bound} prompt tokens + {max_tokens or 1} "
                                        "max_tokens. Shorten the prompt or lower max_tokens.", param="prompt")
    prompts = build_completion_prompts(tokenizer, req.prompt, vocab_size=getattr(tokenizer, "vocab_size", None))
    for p in prompts:
        check_fits(p, max_tokens, max_model_len)
    return prompts


def reasoning_budget(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The reasoning tokens a chat request asked for (reasoning_budget, else reasoning_effort), or None."""
    budget = getattr(req, "reasoning_budget", None)
    effort = getattr(req, "reasoning_effort", None)
    return budget if budget is not None else EFFORT_BUDGETS.get(effort) if effort else None


def check_fits(prompt: Prompt, max_tokens: int | None, max_model_len: int, param: str = "prompt") -> None:
    need = len(prompt.token_ids) + (max_tokens or 1)
    if need > max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens, but the request needs "
            f"{len(prompt.token_ids)} prompt tokens + {max_tokens or 1} max_tokens. Shorten the prompt "
            "or lower max_tokens.", param=param)


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text (special tokens included), for logprobs and traces."""
    return [tokenizer.token_text(t) for t in ids]
