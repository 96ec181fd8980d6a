"""Tool calling on /v1/chat/completions: the parser on real strings, prompts built with the real
SmolLM2 tokenizer, and the real server with the real default model (temperature 0, few tokens).
"""

from __future__ import annotations

import json
import random
import time

import gguf
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion
from servers import engine_server

from kvserve.errors import InvalidRequest
from kvserve.model.registry import resolve
from kvserve.server.generation.context import build_chat_prompt
from kvserve.server.protocol import ChatCompletionRequest, check_caps, parse_body
from kvserve.server.settings import ServerSettings
from kvserve.server.stages.tools import ToolCallParser, make_plan, parse_output, stream_delta
from kvserve.tokenizer import Tokenizer

HTTP = httpx.Client(timeout=300)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
NAMES = frozenset({"get_weather", "get_time"})
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


# ---- parser ---------------------------------------------------------------------------------

def parse(text: str, *, parallel: bool = True, chunk: int | None = None, seed: int = 0):
    """(content, [(name, arguments)]) from feeding `text` whole or in random small pieces."""
    p = ToolCallParser(NAMES, parallel=parallel)
    events = []
    if chunk is None:
        events += p.feed(text)
    else:
        rng, i = random.Random(seed), 0
        while i < len(text):
            k = rng.randint(1, chunk)
            events += p.feed(text[i:i + k])
            i += k
    events += p.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    return content, [(c.name, c.arguments) for c in p.calls]


CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_T = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>'
PARSER_CASES = [
    (CALL_W, "", [("get_weather", '{"city": "Paris"}')]),
    (CALL_W + "\n" + CALL_T, "", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"timezone": "CET"}')]),
    ("Let me check.\n" + CALL_W + "\nOne moment.", "Let me check.\nOne moment.",
     [("get_weather", '{"city": "Paris"}')]),
    # generation ended (EOS / length / stop string) before the closing tag
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', "",
     [("get_weather", '{"city": "Paris"}')]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "", [("get_weather", '{"city": "Par')]),
    # arguments that are not JSON come back as their raw text
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>', "",
     [("get_weather", '{"city": Paris}')]),
    # a function that is not in tools is text
    ('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call> ok',
     '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call> ok', []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    # tags inside JSON strings do not end the block
    (('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a </tool_call> b \\" <tool_call>"}}\n'
      '</tool_call>tail'), "tail", [("get_weather", '{"city": "a </tool_call> b \\" <tool_call>"}')]),
    ('<tool_call>{"arguments": {"timezone": "UTC"}, "name": "get_time"}</tool_call>', "",
     [("get_time", '{"timezone": "UTC"}')]),
    # a new <tool_call> closes an unclosed one
    ('<tool_call>\n{"name": "get_weather", "arguments": {}}\n<tool_call>\n{"name": "get_time"}', "",
     [("get_weather", "{}"), ("get_time", "{}")]),
    # arguments given as a JSON string stay that string
    ('<tool_call>{"name": "get_time", "arguments": "{\\"timezone\\": \\"UTC\\"}"}</tool_call>', "",
     [("get_time", '{"timezone": "UTC"}')]),
    ("a < b, <tool_calls> and <tool", "a < b, <tool_calls> and <tool", []),
    ("  plain text, no calls\n", "  plain text, no calls\n", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), PARSER_CASES)
def test_parser(text, content, calls):
    assert parse(text) == (content, calls)
    for seed in range(30):   # streaming: any split of the text gives the same result
        assert parse(text, chunk=seed % 4 + 1, seed=seed) == (content, calls)


def test_parser_parallel_false_keeps_first_call():
    assert parse(CALL_W + CALL_T + " bye", parallel=False) == ("bye", [("get_weather", '{"city": "Paris"}')])


def test_parser_events_and_stream_delta():
    p = ToolCallParser(NAMES)
    d1 = stream_delta(p.feed('Sure. <tool_call>\n{"name": "get_weather", "argu'))
    assert d1["content"] == "Sure."
    (first,) = d1["tool_calls"]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert len(first["id"]) == 5 + 24 and first["id"][5:].isalnum()
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    d2 = stream_delta(p.feed('ments": {"city": "Oslo"}}\n</tool_call>'))
    assert d2 == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]}
    assert stream_delta(p.finish()) == {}


def test_parse_output_reattaches_forcing_prefix():
    named = make_plan(TOOLS, NAMED, None)
    content, calls = parse_output(named, named.forcing_prefix, ' {"city": "Rome"}}\n</tool_call>')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Rome"}')]
    required = make_plan(TOOLS, "required", None)
    content, calls = parse_output(required, required.forcing_prefix, 'Paris", "arguments": {}}')
    assert calls == [] and content.startswith('<tool_call>\n{"name": "Paris"')


# ---- prompts with the real SmolLM2 tokenizer ------------------------------------------------

@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(resolve(None).path))


def chat_req(**kw) -> ChatCompletionRequest:
    body = {"messages": ASK, **kw}
    req = parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    check_caps(req, ServerSettings(load_model=False))
    return req


def prompt_text(tok, req) -> str:
    plan = make_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    return build_chat_prompt(tok, req.messages, max_model_len=4096, max_tokens=16, truncate=None,
                             tools=plan).text


def test_smollm2_template_has_no_tool_support(tok):
    assert not tok.supports_tools


def test_tools_rendered_into_system_prompt(tok):
    text = prompt_text(tok, chat_req(tools=TOOLS))
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(WEATHER) in text and json.dumps(TIME) in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    assert text.endswith("<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    # the client's system prompt is kept, the tools follow it
    text = prompt_text(tok, chat_req(tools=TOOLS, messages=[{"role": "system", "content": "Be brief."}, *ASK]))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    # tool_choice none: no tools in the prompt (SmolLM2's default system prompt instead)
    text = prompt_text(tok, chat_req(tools=TOOLS, tool_choice="none"))
    assert "<tools>" not in text and "SmolLM" in text


def test_forcing_prefix(tok):
    gen = "<|im_start|>assistant\n"
    assert prompt_text(tok, chat_req(tools=TOOLS, tool_choice="required")).endswith(
        gen + '<tool_call>\n{"name": "')
    assert prompt_text(tok, chat_req(tools=TOOLS, tool_choice=NAMED)).endswith(
        gen + '<tool_call>\n{"name": "get_weather", "arguments":')
    # "required" with a single tool is that tool, named
    assert prompt_text(tok, chat_req(tools=[TIME], tool_choice="required")).endswith(
        gen + '<tool_call>\n{"name": "get_time", "arguments":')
    assert prompt_text(tok, chat_req(tools=TOOLS)).endswith(gen)


HISTORY = [*ASK,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_a", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
               {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
           {"role": "tool", "tool_call_id": "call_a", "content": "18 C, sunny"},
           {"role": "tool", "tool_call_id": "call_b", "content": "14:05"}]


def test_history_with_tool_calls_renders(tok):
    text = prompt_text(tok, chat_req(tools=TOOLS, messages=HISTORY))
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n') in text
    assert ("<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n14:05\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert "<|im_start|>tool" not in text


# A template that renders tools itself (written after Qwen2.5's, which follows the same format).
NATIVE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}\n<|im_start|>assistant{% for c in m.tool_calls %}"
    "\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>"
    "{%- elif m.role == 'tool' %}\n<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>"
    "{%- else %}\n<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}")


def test_template_with_tool_support_gets_tools(tok):
    native = Tokenizer(tok.hf, bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids,
                       chat_template=NATIVE_TEMPLATE)
    assert native.supports_tools
    text = prompt_text(native, chat_req(tools=TOOLS, messages=HISTORY, tool_choice=NAMED))
    assert text.startswith("<|im_start|>system\nTOOLS:") and json.dumps(WEATHER) in text and json.dumps(TIME) in text
    assert "# Tools" not in text   # the template's own format, not the injected one
    assert '"arguments": {"city": "Paris"}' in text   # arguments passed as an object
    assert text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments":')


# ---- validation -----------------------------------------------------------------------------

BAD_REQUESTS = [
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools[0].function.extra"),
    ({"tools": []}, "tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": TOOLS, "tool_choice": {"type": "web", "function": {"name": "get_time"}}}, "tool_choice.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "add_generation_prompt": False}, "tool_choice"),
    ({"messages": [*ASK, {"role": "tool", "content": "18 C"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "18 C"}]},
     "messages[1].tool_call_id"),
    ({"messages": [*HISTORY[:2], {"role": "tool", "tool_call_id": "call_zzz", "content": "x"}]},
     "messages[2].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": HISTORY[1]["tool_calls"]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_REQUESTS)
def test_invalid_tool_requests(extra, param):
    with pytest.raises(InvalidRequest) as e:
        chat_req(**extra)
    assert e.value.param == param, e.value.message


def test_valid_tool_requests():
    chat_req(tools=TOOLS, tool_choice="auto", parallel_tool_calls=False)
    chat_req(tools=TOOLS, tool_choice="none")
    chat_req(tools=[{"type": "function", "function": {"name": "no-params_1"}}], tool_choice="required")
    chat_req(tools=TOOLS, messages=HISTORY)
    chat_req(messages=HISTORY)   # tool turns in the history without tools in this request


# ---- the real server with the real default model --------------------------------------------

@pytest.fixture(scope="module")
def srv(tmp_path_factory, model_server, engine_kind):
    yield from engine_server(tmp_path_factory, model_server, "tools", engine_kind, "--max-model-len", "1024")


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)


def post(srv, **body) -> httpx.Response:
    return HTTP.post(srv.base_url + "/v1/chat/completions", json={"messages": ASK, "temperature": 0, **body})


def sse_chunks(srv, **body) -> tuple[list[dict], list[str]]:
    with HTTP.stream("POST", srv.base_url + "/v1/chat/completions",
                     json={"messages": ASK, "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"], lines


def assemble(chunks: list[dict]) -> tuple[str, dict[int, dict], str | None]:
    """Content, tool calls by index and finish reason of choice 0, as an OpenAI client assembles them."""
    content, calls, finish = "", {}, None
    for c in chunks:
        for ch in c["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                cur = calls.setdefault(tc["index"], {"id": None, "type": None, "name": "", "arguments": ""})
                cur["id"] = tc.get("id") or cur["id"]
                cur["type"] = tc.get("type") or cur["type"]
                cur["name"] += tc.get("function", {}).get("name") or ""
                cur["arguments"] += tc.get("function", {}).get("arguments") or ""
            finish = ch["finish_reason"] or finish
    return content, calls, finish


def test_named_tool_choice(srv, client):
    resp = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                          temperature=0, max_tokens=24)
    (choice,) = resp.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    # a string; JSON when the model closed the object within max_tokens, else the raw text
    assert isinstance(call.function.arguments, str) and call.function.arguments
    assert call.id.startswith("call_") and len(call.id) == 29
    assert resp.usage.completion_tokens > 0


def test_named_tool_choice_streaming(srv):
    body = {"tools": TOOLS, "tool_choice": NAMED, "max_tokens": 24, "kvserve_trace": True,
            "stream_options": {"include_usage": True}, "logprobs": True}
    chunks, lines = sse_chunks(srv, **body)
    assert lines[-1] == "[DONE]"
    content, calls, finish = assemble(chunks)
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["type"] == "function"
    assert calls[0]["id"].startswith("call_")
    # the deltas hold what the generated text (the trace's output tokens) parses into
    trace = next(c["kvserve_trace"] for c in chunks if "kvserve_trace" in c)
    assert trace["prompt_text"].endswith('<tool_call>\n{"name": "get_weather", "arguments":')
    plan = make_plan(TOOLS, NAMED, None)
    text = "".join(t["text"] for t in trace["output_tokens"])
    ref_content, (ref,) = parse_output(plan, plan.forcing_prefix, text)
    assert calls[0]["arguments"] == ref.arguments and (content or None) == ref_content
    # usage, logprobs and the trace still come through the stream
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert any(ch["logprobs"] for c in chunks for ch in c["choices"])
    assert sum(len(ch["logprobs"]["content"]) for c in chunks for ch in c["choices"] if ch["logprobs"]) \
        == chunks[-1]["usage"]["completion_tokens"]
    assert any("kvserve_trace" in c for c in chunks)


def test_named_n2_each_choice_parsed_and_logged(srv):
    rid = "tool-calls-n2"
    r = HTTP.post(srv.base_url + "/v1/chat/completions", headers={"x-request-id": rid},
                  json={"messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "n": 2, "temperature": 0.8,
                        "seed": 7, "max_tokens": 16})
    body = ChatCompletion.model_validate(r.json())
    ids = set()
    for ch in body.choices:
        (call,) = ch.message.tool_calls
        assert ch.finish_reason == "tool_calls" and call.function.name == "get_weather"
        ids.add(call.id)
    assert len(ids) == 2
    deadline = time.monotonic() + 30   # the log line is written right after the response
    while not (lines := [json.loads(x) for x in srv.access_log() if rid in x]) and time.monotonic() < deadline:
        time.sleep(0.1)
    (line,) = lines
    assert line["status"] == 200 and line["finish_reason"] == "tool_calls" and line["tool_calls"] == 1


def test_required_tool_choice(srv):
    """SmolLM2-135M continues '{"name": "' with a function name or with something else; either
    way the answer is well formed: a call to a given function, or the text as content."""
    r = post(srv, tools=TOOLS, tool_choice="required", max_tokens=24)
    body = ChatCompletion.model_validate(r.json()).model_dump()
    choice = body["choices"][0]
    if choice["message"]["tool_calls"]:
        assert choice["finish_reason"] in ("tool_calls", "length")    # "length": max_tokens cut the call off
        assert all(c["function"]["name"] in NAMES for c in choice["message"]["tool_calls"])
        assert all(isinstance(c["function"]["arguments"], str) for c in choice["message"]["tool_calls"])
    else:
        assert choice["finish_reason"] in ("stop", "length")
        assert choice["message"]["content"].startswith('<tool_call>\n{"name": "')


def test_auto_and_none(srv):
    for choice in ("auto", "none"):
        r = post(srv, tools=TOOLS, tool_choice=choice, max_tokens=8, n=2, seed=3)
        body = ChatCompletion.model_validate(r.json())
        for ch in body.choices:
            if ch.message.tool_calls:
                assert choice == "auto" and ch.finish_reason == "tool_calls"
            else:
                assert isinstance(ch.message.content, str) and ch.finish_reason in ("stop", "length")


def test_round_trip(srv, client):
    first = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           temperature=0, max_tokens=24)
    msg = first.choices[0].message
    history = [*ASK, msg.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature_c": 18})}
                for c in msg.tool_calls]
    resp = client.chat.completions.create(model="", messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    (choice,) = resp.choices
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_tool_requests_rejected_over_http(srv):
    r = post(srv, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "launch"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = post(srv, tools=[{"type": "function", "function": {"name": "a b"}}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.name"


def test_tokenize_counts_tools(srv):
    plain = HTTP.post(srv.base_url + "/tokenize", json={"messages": ASK}).json()["count"]
    with_tools = HTTP.post(srv.base_url + "/tokenize", json={"messages": ASK, "tools": TOOLS}).json()["count"]
    assert with_tools > plain + 50
