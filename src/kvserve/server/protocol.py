"""Request bodies of the OpenAI API, parsed strictly, and the translation to SamplingParams.

Unknown fields are rejected everywhere (400, `param` names the field), so a typo such as
`max_token` fails loudly instead of being silently ignored. A short list of OpenAI fields that
cannot change the output here (`store`, `metadata`, `service_tier`, `user`; on messages `name`,
`refusal`, `annotations`) is accepted and ignored. Tool calling (`tools`, `tool_choice`,
`parallel_tool_calls`, assistant `tool_calls`, `tool` messages) is checked here and carried out
by kvserve.server.stages.tools.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvserve.errors import InvalidRequest
from kvserve.sampling_params import RepetitionGuard, SamplingParams, StructuredOutputsParams
from kvserve.server.gates.limits import BodyLimits, load_json, read_json
from kvserve.server.settings import ServerSettings
from kvserve.server.stages.tools import MAX_TOOLS
from kvserve.server.stages.tools import NAME_RE as TOOL_NAME_RE

MAX_TEMPERATURE = 2.0   # OpenAI's range; SamplingParams itself (offline use) allows more


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any]


class ToolCall(_Strict):
    """A call the assistant made earlier in the conversation (arguments: a JSON string)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class RepetitionGuardSpec(_Strict):
    """End a generation stuck in a loop (finish_reason "repetition"): see SamplingParams."""

    window: int = 16
    repeats: int = 4


class ModerationSpec(_Strict):
    """A request's own moderation choices, when its key's policy lets it (server/gates/moderation.py):
    `action` "annotate" reports verdicts without blocking; `pii_output` turns output redaction on or off."""

    action: Literal["block", "annotate"] | None = None
    pii_output: Literal["off", "redact"] | None = None


class _Common(_Strict):
    """Fields shared by chat and completions: OpenAI's, vLLM's extras, and kvserve's extensions."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # ignored OpenAI fields
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # kvserve extensions
    kvserve_trace: bool = False
    speculative: bool = True      # false: this request never uses speculative decoding
    priority: int = 0
    cache_salt: str | None = Field(default=None, max_length=256)
    repetition_guard: RepetitionGuardSpec | None = None
    kvserve_moderation: ModerationSpec | None = None
    # vLLM's beam-search fields: accepted so that clients get a clear answer, not "unrecognized"
    use_beam_search: bool = False
    length_penalty: float | None = None
    # structured output (OpenAI's response_format, vLLM's extras): kvserve.server.stages.structured
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None   # checked in check_tools (clearer errors)
    parallel_tool_calls: bool | None = None
    truncate: Literal["oldest"] | None = None
    add_generation_prompt: bool = True
    reasoning_effort: Literal["low", "medium", "high"] | None = None   # think first (server/stages/reasoning.py)
    reasoning_budget: int | None = Field(default=None, ge=1)           # ... for at most this many tokens
    cache: bool | None = None   # false: never answered from (nor stored in) the semantic cache

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    cache: bool | None = None   # false: never answered from (nor stored in) the semantic cache

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[TextPart]", "list[str]", "list[int]", "list[list[int]]", "int", "float"):
            continue  # union branch names pydantic puts in the location
        else:
            out += ("." if out else "") + str(part)
    return out


def parse_body(raw: bytes, model: type[BaseModel], max_depth: int = 64) -> Any:
    """Parse and validate a JSON body; every failure is an InvalidRequest naming the field."""
    return validate_body(load_json(raw, max_depth), model)


async def read_request(request: Request, model: type[BaseModel], limits: BodyLimits) -> Any:
    """A route's body read under `limits` (gates/limits.py) and validated as `model`."""
    return validate_body(await read_json(request, limits), model)


def validate_body(data: Any, model: type[BaseModel]) -> Any:
    """Validate a parsed body (an API's translation into a chat request, say) as `parse_body` does."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param(tuple(err["loc"]))
        if err["type"] == "extra_forbidden":
            raise InvalidRequest(f"Unrecognized request argument supplied: {param}. Remove it; see "
                                 "docs/api.md for the fields kvserve accepts.", param=param) from None
        if err["type"] == "missing":
            raise InvalidRequest(f"Missing required parameter: {param}.", param=param) from None
        raise InvalidRequest(f"Invalid value for {param}: {err['msg']}.", param=param) from None


def check_caps(req: _Common, settings: ServerSettings) -> None:
    """Server-side caps, beyond what SamplingParams validates (the table is in docs/api.md)."""
    if req.temperature is not None and not 0 <= req.temperature <= MAX_TEMPERATURE:
        raise InvalidRequest(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (as OpenAI's), got "
                             f"{req.temperature!r}.", param="temperature")
    if req.use_beam_search:
        raise InvalidRequest("use_beam_search is not served over HTTP: beam search runs offline through "
                             "kvserve.LLM.generate(..., SamplingParams(use_beam_search=True)). Use n/best_of "
                             "for several candidates.", param="use_beam_search")
    if req.length_penalty is not None:
        raise InvalidRequest("length_penalty only applies to beam search, which is not served over HTTP.",
                             param="length_penalty")
    if req.n > settings.max_n:
        raise InvalidRequest(f"n must be at most {settings.max_n}.", param="n")
    if req.best_of is not None and req.best_of > settings.max_best_of:
        raise InvalidRequest(f"best_of must be at most {settings.max_best_of}.", param="best_of")
    if isinstance(req.stop, list) and len(req.stop) > settings.max_stop:
        raise InvalidRequest(f"At most {settings.max_stop} stop strings are allowed.", param="stop")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if any(len(s) > settings.max_stop_chars for s in stops):
        raise InvalidRequest(f"Each stop string may hold at most {settings.max_stop_chars} characters.",
                             param="stop")
    if req.logit_bias is not None and len(req.logit_bias) > settings.max_logit_bias:
        raise InvalidRequest(f"logit_bias may hold at most {settings.max_logit_bias} entries.",
                             param="logit_bias")
    if isinstance(req, ChatCompletionRequest):
        if not req.messages:
            raise InvalidRequest("messages must contain at least one message.", param="messages")
        if len(req.messages) > settings.max_messages:
            raise InvalidRequest(f"At most {settings.max_messages} messages are allowed; drop older "
                                 "turns or send truncate: \"oldest\".", param="messages")
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= settings.max_top_logprobs:
                raise InvalidRequest(f"top_logprobs must be in [0, {settings.max_top_logprobs}].",
                                     param="top_logprobs")
            if not req.logprobs:
                raise InvalidRequest("top_logprobs requires logprobs: true.", param="top_logprobs")
        check_tools(req, settings.max_tools, settings.max_tools_bytes)
        if (req.reasoning_effort or req.reasoning_budget) and (req.tool_choice == "required"
                                                               or isinstance(req.tool_choice, dict)):
            raise InvalidRequest("reasoning cannot be combined with a forced tool_choice; use \"auto\".",
                                 param="tool_choice")
    else:
        assert isinstance(req, CompletionRequest)
        if req.logprobs is not None and not 0 <= req.logprobs <= settings.max_top_logprobs:
            raise InvalidRequest(f"logprobs must be in [0, {settings.max_top_logprobs}].", param="logprobs")
        if req.suffix:
            raise InvalidRequest("suffix is not supported.", param="suffix")
        one_of_ids = isinstance(req.prompt, list) and bool(req.prompt) and all(
            isinstance(t, int) for t in req.prompt)          # [ids]: one prompt of token ids, not len(ids) prompts
        if isinstance(req.prompt, list) and not one_of_ids and (not req.prompt
                                                                or len(req.prompt) > settings.max_prompts):
            raise InvalidRequest(f"prompt lists must hold 1 to {settings.max_prompts} prompts.",
                                 param="prompt")
    for name in ("max_tokens",) + (("max_completion_tokens",) if isinstance(req, ChatCompletionRequest)
                                   else ()):
        value = getattr(req, name)
        if value is not None and value < 1:
            raise InvalidRequest(f"{name} must be at least 1.", param=name)


def _validation_error(e: ValidationError, prefix: str) -> InvalidRequest:
    err = e.errors()[0]
    param = prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return InvalidRequest(f"Unrecognized request argument supplied: {param}.", param=param)
    if err["type"] == "missing":
        return InvalidRequest(f"Missing required parameter: {param}.", param=param)
    return InvalidRequest(f"Invalid value for {param}: {err['msg']}.", param=param)


def check_tools(req: ChatCompletionRequest, max_tools: int = MAX_TOOLS, max_bytes: int = 1 << 18) -> None:
    """tools / tool_choice / parallel_tool_calls and the tool turns of the conversation."""
    names: list[str] = []
    if req.tools is not None:
        if not req.tools:
            raise InvalidRequest("tools must hold at least one tool; omit it for none.", param="tools")
        if len(req.tools) > max_tools:
            raise InvalidRequest(f"At most {max_tools} tools are allowed.", param="tools")
        size = len(json.dumps([t.model_dump(exclude_none=True) for t in req.tools]))
        if size > max_bytes:
            raise InvalidRequest(f"The tool definitions take {size} bytes of JSON; at most {max_bytes} are "
                                 "allowed.", param="tools")
        for i, tool in enumerate(req.tools):
            name = tool.function.name
            if not TOOL_NAME_RE.fullmatch(name):
                raise InvalidRequest(f"Invalid tools[{i}].function.name {name!r}: function names are 1-64 "
                                     "characters of a-z, A-Z, 0-9, underscores and dashes.",
                                     param=f"tools[{i}].function.name")
            if name in names:
                raise InvalidRequest(f"Duplicate function name {name!r} in tools[{i}]; tool names must be "
                                     "unique.", param=f"tools[{i}].function.name")
            names.append(name)
    choice = req.tool_choice
    if isinstance(choice, dict):
        try:
            named = NamedToolChoice.model_validate(choice)
        except ValidationError as e:
            raise _validation_error(e, "tool_choice") from None
        if not names:
            raise InvalidRequest("tool_choice names a function but no tools were given.", param="tool_choice")
        if named.function.name not in names:
            raise InvalidRequest(f"tool_choice names function {named.function.name!r}, which is not in tools "
                                 f"({', '.join(names)}).", param="tool_choice")
    elif choice is not None:
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest(f"Invalid value for tool_choice: {choice!r}. Use \"none\", \"auto\", "
                                 "\"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                                 param="tool_choice")
        if choice == "required" and not names:
            raise InvalidRequest('tool_choice "required" needs tools.', param="tool_choice")
    if req.parallel_tool_calls is not None and not names:
        raise InvalidRequest("parallel_tool_calls is only allowed when tools are given.",
                             param="parallel_tool_calls")
    forced = isinstance(choice, dict) or choice == "required"
    if forced and not req.add_generation_prompt:
        raise InvalidRequest("A forced tool_choice needs add_generation_prompt: true.", param="tool_choice")
    open_ids: set[str] = set()   # ids of the calls the latest assistant turn made
    for i, m in enumerate(req.messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise InvalidRequest("Only assistant messages can have tool_calls.", param=f"messages[{i}].tool_calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise InvalidRequest("Only tool messages can have tool_call_id.", param=f"messages[{i}].tool_call_id")
        if m.role == "tool":
            if m.tool_call_id is None:
                raise InvalidRequest("A tool message needs the tool_call_id of the call it answers.",
                                     param=f"messages[{i}].tool_call_id")
            if m.tool_call_id not in open_ids:
                raise InvalidRequest("Messages with role 'tool' must answer a preceding assistant message "
                                     f"with tool_calls; no such call has id {m.tool_call_id!r}.",
                                     param=f"messages[{i}].tool_call_id")
            if m.content is None:
                raise InvalidRequest("A tool message needs content.", param=f"messages[{i}].content")
        elif m.role == "assistant" and m.tool_calls:
            open_ids = {c.id for c in m.tool_calls}
            for j, c in enumerate(m.tool_calls):
                if not c.function.name:
                    raise InvalidRequest("A tool call needs a function name.",
                                         param=f"messages[{i}].tool_calls[{j}].function.name")
        else:
            open_ids = set()


def to_sampling_params(req: _Common, max_tokens: int, *, logprobs: int | None,
                       prompt_logprobs: int | None = None, extra_stop: list[str] | None = None,
                       structured: StructuredOutputsParams | None = None,
                       reasoning_budget: int | None = None) -> SamplingParams:
    """SamplingParams for one request; its __post_init__ raises InvalidRequest(param=...).

    `extra_stop` holds the server's own stop strings (the end of a single forced tool call)."""
    stop = req.stop
    if extra_stop:
        mine = [stop] if isinstance(stop, str) else list(stop or [])
        stop = mine + [s for s in extra_stop if s not in mine]
    kwargs: dict[str, Any] = {
        "n": req.n, "best_of": req.best_of, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty, "logit_bias": req.logit_bias, "seed": req.seed,
        "max_tokens": max_tokens, "min_tokens": min(req.min_tokens, max_tokens), "stop": stop,
        "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": req.include_stop_str_in_output, "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs, "skip_special_tokens": req.skip_special_tokens,
        "structured_outputs": structured, "reasoning_budget": reasoning_budget, "speculative": req.speculative}
    if req.repetition_guard is not None:
        kwargs["repetition_guard"] = RepetitionGuard(req.repetition_guard.window, req.repetition_guard.repeats)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    return SamplingParams(**kwargs)
