"""Request bodies of the OpenAI API, parsed strictly, and the translation to SamplingParams.

Unknown fields are rejected everywhere (400, `param` names the field), so a typo such as
`max_token` fails loudly instead of being silently ignored. A short list of OpenAI fields that
cannot change the output here (`store`, `metadata`, `service_tier`, `parallel_tool_calls`,
`user`; on messages `name`, `refusal`, `annotations`) is accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvserve.errors import InvalidRequest
from kvserve.sampling_params import RepetitionGuard, SamplingParams
from kvserve.server.settings import ServerSettings


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
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
    priority: int = 0
    cache_salt: str | None = Field(default=None, max_length=256)
    repetition_guard: RepetitionGuardSpec | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: Literal["none", "auto"] | None = None
    response_format: dict[str, Any] | None = None
    truncate: Literal["oldest"] | None = None
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


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


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Parse and validate a JSON body; every failure is an InvalidRequest naming the field."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"The request body is not valid JSON ({e}).") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
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
    """Server-side caps, beyond what SamplingParams validates."""
    if req.n > settings.max_n:
        raise InvalidRequest(f"n must be at most {settings.max_n}.", param="n")
    if req.best_of is not None and req.best_of > settings.max_best_of:
        raise InvalidRequest(f"best_of must be at most {settings.max_best_of}.", param="best_of")
    if isinstance(req.stop, list) and len(req.stop) > settings.max_stop:
        raise InvalidRequest(f"At most {settings.max_stop} stop strings are allowed.", param="stop")
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
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise InvalidRequest("Only response_format {\"type\": \"text\"} is supported.",
                                 param="response_format")
    else:
        assert isinstance(req, CompletionRequest)
        if req.logprobs is not None and not 0 <= req.logprobs <= settings.max_top_logprobs:
            raise InvalidRequest(f"logprobs must be in [0, {settings.max_top_logprobs}].", param="logprobs")
        if req.suffix:
            raise InvalidRequest("suffix is not supported.", param="suffix")
        if isinstance(req.prompt, list) and (not req.prompt or len(req.prompt) > settings.max_prompts):
            raise InvalidRequest(f"prompt lists must hold 1 to {settings.max_prompts} prompts.",
                                 param="prompt")
    for name in ("max_tokens",) + (("max_completion_tokens",) if isinstance(req, ChatCompletionRequest)
                                   else ()):
        value = getattr(req, name)
        if value is not None and value < 1:
            raise InvalidRequest(f"{name} must be at least 1.", param=name)


def to_sampling_params(req: _Common, max_tokens: int, *, logprobs: int | None,
                       prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams for one request; its __post_init__ raises InvalidRequest(param=...)."""
    kwargs: dict[str, Any] = {
        "n": req.n, "best_of": req.best_of, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty, "logit_bias": req.logit_bias, "seed": req.seed,
        "max_tokens": max_tokens, "min_tokens": min(req.min_tokens, max_tokens), "stop": req.stop,
        "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": req.include_stop_str_in_output, "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs, "skip_special_tokens": req.skip_special_tokens}
    if req.repetition_guard is not None:
        kwargs["repetition_guard"] = RepetitionGuard(req.repetition_guard.window, req.repetition_guard.repeats)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    return SamplingParams(**kwargs)
