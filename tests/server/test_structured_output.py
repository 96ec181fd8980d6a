"""Structured output over HTTP with the real default model: response_format (json_object,
json_schema), vLLM's guided_* extras and structured_outputs on chat and completions, streamed
and not; forced tool calls whose names and arguments must be valid every time; bad specs as
OpenAI-shaped 400s naming the failing path or keyword."""

from __future__ import annotations

import asyncio
import json

import gguf
import httpx
import jsonschema
import openai
import pytest
from servers import engine_server

from kvserve.errors import InvalidRequest
from kvserve.model.registry import resolve
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.grammar import GrammarCompiler
from kvserve.tokenizer import Tokenizer

HTTP = httpx.Client(timeout=300)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                    "maxItems": 2}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def srv(tmp_path_factory, model_server, engine_kind):
    yield from engine_server(tmp_path_factory, model_server, "structured", engine_kind, "--max-model-len", "1024")


def post(srv, path: str = "/v1/chat/completions", **body) -> httpx.Response:
    if path.endswith("chat/completions"):
        body.setdefault("messages", ASK)
    return HTTP.post(srv.base_url + path, json={"temperature": 0, **body})


def stream_text(srv, path: str, **body) -> tuple[str, str | None]:
    text, finish = "", None
    with HTTP.stream("POST", srv.base_url + path, json={"temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    text += (ch.get("delta") or {}).get("content") or ch.get("text") or ""
                    finish = ch["finish_reason"] or finish
    return text, finish


def test_response_format_json_schema_and_json_object(srv):
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    resp = client.chat.completions.create(model="", messages=ASK, response_format=fmt, n=3, temperature=1.0,
                                          seed=5, max_tokens=120)
    for ch in resp.choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), PERSON)
    text, finish = stream_text(srv, "/v1/chat/completions", messages=ASK, max_tokens=200,
                               response_format={"type": "json_object"})
    assert finish == "stop" and isinstance(json.loads(text), dict)


def test_guided_extras_on_completions_and_chat(srv):
    r = post(srv, "/v1/completions", prompt="Is the sky blue? Answer:", max_tokens=8,
             guided_choice=["yes", "no"])
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")
    text, finish = stream_text(srv, "/v1/completions", prompt="A date:", max_tokens=20,
                               guided_regex="[0-9]{4}-[0-9]{2}-[0-9]{2}")
    assert finish == "stop" and len(text) == 10 and text[4] == text[7] == "-"
    r = post(srv, max_tokens=60, guided_json=PERSON)
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), PERSON)
    r = post(srv, max_tokens=20, guided_grammar='start: "The answer is " ("yes" | "no") "."')
    assert r.json()["choices"][0]["message"]["content"] in ("The answer is yes.", "The answer is no.")
    r = post(srv, "/v1/completions", prompt="x", max_tokens=8, structured_outputs={"choice": ["a", "b"]})
    assert r.json()["choices"][0]["text"] in ("a", "b")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_are_always_valid(srv, tool_choice):
    """One call each (a grammar-complete call ends the answer); parallel calls go on until the model
    stops, and one cut off by max_tokens cannot be valid."""
    for question in ("What is the weather in Paris?", "Add 2 and 40."):
        r = post(srv, messages=[{"role": "user", "content": question}], tools=TOOLS, tool_choice=tool_choice,
                 parallel_tool_calls=False, n=4, temperature=1.0, seed=11, max_tokens=80)
        assert r.status_code == 200, r.text
        for ch in r.json()["choices"]:
            assert ch["finish_reason"] == "tool_calls" and len(ch["message"]["tool_calls"]) == 1, ch
            for call in ch["message"]["tool_calls"]:
                name = call["function"]["name"]
                assert name in SCHEMAS and (isinstance(tool_choice, str) or name == "add")
                jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_auto_tool_calls_are_valid_when_made(srv):
    r = post(srv, messages=[{"role": "user", "content": "What is the weather in Paris? Use a tool."}],
             tools=TOOLS, tool_choice="auto", n=4, temperature=1.0, seed=2, max_tokens=80)
    for ch in r.json()["choices"]:
        for call in ch["message"]["tool_calls"] or []:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


@pytest.mark.parametrize("body, param, word", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format.json_schema.schema.properties.a.type", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}},
     "response_format.json_schema.schema.properties.a.uniqueItems", "uniqueItems"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", "name"),
    ({"guided_regex": "(a", "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "does not compile"),
    ({"guided_json": {"type": "object", "properties": {"a": {"if": {}}}}}, "guided_json.properties.a.if", "'if'"),
    ({"tools": [ADD], "tool_choice": "required", "guided_choice": ["a"]}, "guided_choice", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "not": {"const": 1}}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters.properties.a.not", "'not'"),
])
def test_bad_specs_are_400s(srv, body, param, word):
    r = post(srv, max_tokens=4, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and word in err["message"], err


def test_reasoning_split_budget_and_grammar_after(srv):
    """reasoning_budget opens a <think> block, the engine closes it after the budget, the grammar
    constrains only the answer; streamed and non-streamed answers agree."""
    body = {"messages": [{"role": "user", "content": "Is 7 prime? Answer yes or no."}], "max_tokens": 60,
            "reasoning_budget": 12, "guided_choice": ["yes", "no"], "kvserve_trace": True}
    r = post(srv, **body).json()
    msg, trace = r["choices"][0]["message"], r["kvserve_trace"]
    assert msg["content"] in ("yes", "no") and msg["reasoning_content"] and "think>" not in msg["reasoning_content"]
    assert 12 <= trace["reasoning_token_count"] < trace["completion_token_count"]
    reasoning = content = ""
    with HTTP.stream("POST", srv.base_url + "/v1/chat/completions",
                     json={"temperature": 0, "stream": True, **body}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    reasoning += ch["delta"].get("reasoning_content") or ""
                    content += ch["delta"].get("content") or ""
    assert (reasoning, content) == (msg["reasoning_content"], msg["content"])
    r = post(srv, max_tokens=8, reasoning_effort="low", tools=TOOLS, tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_compile_time_limit():
    """A grammar still compiling when its time is up is refused (400); the loop was never blocked."""
    comp = GrammarCompiler(Tokenizer.from_gguf(gguf.GGUFReader(resolve(None).path)), 49152)
    so = StructuredOutputsParams(grammar='start: "a"')
    with pytest.raises(InvalidRequest, match="took longer"):
        asyncio.run(comp.prepare_async(so, timeout=0))
    assert asyncio.run(comp.prepare_async(so, timeout=30))
