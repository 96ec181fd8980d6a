"""Anthropic's Messages API with the official `anthropic` SDK against the real model: create,
streaming (text, tool use, thinking), count_tokens, errors in Anthropic's shape, and the wire
bytes checked against the SDK's own event and message types (no field it does not know, the
documented event order). The gateway's gates apply as on OpenAI's routes: a key (x-api-key or
Bearer), the request bucket, input moderation, the usage ledger."""

from __future__ import annotations

import json
import re

import anthropic
import client_api_server
import httpx
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from client_api_server import (  # noqa: F401 (no_client_warnings: an autouse fixture)
    ECHO,
    NO_CLIENT_WARNINGS,
    no_client_warnings,
    unknown_fields,
)

from kvserve.server.api.anthropic_wire import thinking_signature
from kvserve.server.stores.keys import KeyStore

pytestmark = NO_CLIENT_WARNINGS
MODEL = "smollm2-135m-instruct"
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
# Anthropic's documented stream: message_start, content blocks (start, deltas, stop), message_delta, message_stop;
# ping may come anywhere.
STREAM_ORDER = re.compile(r"message_start (content_block_start (content_block_delta )*content_block_stop )*"
                          r"message_delta message_stop ")


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_server):
    return client_api_server.start(tmp_path_factory, model_server, "anthropic", list(ROUTES))


def client(server, key: str = "a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=server.keys[key], max_retries=0, timeout=300)


def raw_stream(server, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", server.base_url + "/v1/messages", json={**body, "stream": True}, timeout=300,
                      headers={"x-api-key": server.keys["a"]}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        events.append((kind[7:], json.loads(data[6:])))
    return events


def check_stream(events: list[tuple[str, dict]]) -> None:
    adapter = pydantic.TypeAdapter(RawMessageStreamEvent)
    names = ""
    for kind, data in events:
        assert data["type"] == kind
        if kind == "ping":
            continue
        assert unknown_fields(adapter.validate_python(data)) == [], data
        names += kind + " "
    assert STREAM_ORDER.fullmatch(names), names
    opened = [d["index"] for k, d in events if k == "content_block_start"]
    assert opened == list(range(len(opened)))


def test_create_text(server):
    c = client(server)
    m = c.messages.create(model=MODEL, max_tokens=12, system="Be brief.", extra_body={"temperature": 0},
                          messages=[{"role": "user", "content": "Say hi."}], metadata={"user_id": "u1"})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 0
    body = httpx.post(server.base_url + "/v1/messages", timeout=300, headers={"Authorization": f"Bearer {server.keys['a']}"},
                      json={"model": MODEL, "max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}],
                            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    assert body.status_code == 200, body.text
    assert unknown_fields(Message.model_validate(body.json())) == []


def test_stop_sequences_and_sampling(server):
    c = client(server)
    # this SDK no longer has temperature/top_p/top_k arguments; older clients send them, as extra_body does
    m = c.messages.create(model=MODEL, max_tokens=40, extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 20},
                          messages=[{"role": "user", "content": "Count from one to ten in words."}],
                          stop_sequences=["three", "Three"])
    if m.stop_reason == "stop_sequence":
        assert m.stop_sequence in ("three", "Three") and m.stop_sequence not in m.content[0].text


def test_stream_text(server):
    c = client(server)
    with c.messages.stream(model=MODEL, max_tokens=16, extra_body={"temperature": 0},
                           messages=[{"role": "user", "content": "Count from one to five."}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.content[0].text == text and final.usage.output_tokens > 0
    events = raw_stream(server, {"model": MODEL, "max_tokens": 16, "temperature": 0,
                                 "messages": [{"role": "user", "content": "Count from one to five."}]})
    check_stream(events)
    assert "ping" in [k for k, _ in events]
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == text   # greedy: the same


def test_tool_use_create_stream_and_result(server):
    c = client(server)
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    m = c.messages.create(model=MODEL, max_tokens=48, extra_body={"temperature": 0}, tools=[WEATHER], messages=ask,
                          tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use"
    call = next(b for b in m.content if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str) and call.id.startswith("toolu_")
    with c.messages.stream(model=MODEL, max_tokens=48, extra_body={"temperature": 0}, tools=[WEATHER], messages=ask,
                           tool_choice={"type": "any"}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    streamed = next(b for b in final.content if b.type == "tool_use")
    assert streamed.input == call.input
    check_stream(raw_stream(server, {"model": MODEL, "max_tokens": 48, "temperature": 0, "tools": [WEATHER],
                                     "messages": ask, "tool_choice": {"type": "tool", "name": "get_weather"}}))
    follow = c.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0}, tools=[WEATHER], messages=ask + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24C"}]}])
    assert follow.content and follow.usage.input_tokens + follow.usage.cache_read_input_tokens > m.usage.input_tokens


def test_thinking_blocks(server):
    c = client(server)
    with c.messages.stream(model=MODEL, max_tokens=24, thinking={"type": "enabled", "budget_tokens": 8},
                           messages=[{"role": "user", "content": "Is 7 prime?"}]) as s:
        kinds = {getattr(e, "type", None) for e in s}
        final = s.get_final_message()
    block = final.content[0]
    assert block.type == "thinking" and block.thinking and "thinking" in kinds
    assert "signature" in kinds and block.signature == thinking_signature(block.thinking)   # from signature_delta
    adaptive = c.messages.create(model=MODEL, max_tokens=24, thinking={"type": "adaptive"},
                                 output_config={"effort": "low"}, messages=[{"role": "user", "content": "Is 7 prime?"}])
    assert adaptive.content[0].type == "thinking"
    assert adaptive.content[0].signature == thinking_signature(adaptive.content[0].thinking)
    events = raw_stream(server, {"model": MODEL, "max_tokens": 24, "thinking": {"type": "enabled", "budget_tokens": 8},
                                 "messages": [{"role": "user", "content": "Is 7 prime?"}]})
    check_stream(events)
    kinds_of = [(k, d.get("delta", {}).get("type"), d.get("index")) for k, d in events if k != "ping"]
    stop = kinds_of.index(("content_block_stop", None, 0))            # the thinking block is the first
    assert kinds_of[stop - 1] == ("content_block_delta", "signature_delta", 0)
    assert [t for _, t, _ in kinds_of].count("signature_delta") == 1
    # the thinking block passed back as received (as in a tool loop), or with another server's signature
    for signature in (block.signature, "EqQBCkgIARABGAIiQL..."):
        again = c.messages.create(model=MODEL, max_tokens=8, thinking={"type": "enabled", "budget_tokens": 4},
                                  messages=[{"role": "user", "content": "Is 7 prime?"},
                                            {"role": "assistant", "content": [
                                                {"type": "thinking", "thinking": block.thinking, "signature": signature},
                                                {"type": "text", "text": "Yes."}]},
                                            {"role": "user", "content": "And 9?"}])
        assert again.content and again.content[0].type == "thinking"


def test_thinking_signature_is_a_digest_of_the_text():
    assert thinking_signature("a") == thinking_signature("a") != thinking_signature("b")
    assert thinking_signature("a").startswith("kvs1") and len(thinking_signature("x" * 10_000)) < 60


def test_structured_output(server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    m = client(server).messages.create(model=MODEL, max_tokens=32, messages=[{"role": "user", "content": "Is 7 prime?"}],
                                       output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(m.content[0].text)["answer"] in ("yes", "no")


def test_count_tokens(server):
    c = client(server)
    small = c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    more = c.messages.count_tokens(model=MODEL, system="You are terse.", tools=[WEATHER],
                                   messages=[{"role": "user", "content": "Hi"}])
    assert 0 < small.input_tokens < more.input_tokens
    m = c.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == small.input_tokens


def test_errors_in_anthropic_shape(server):
    c = client(server)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=0)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.base_url + "/v1/messages", headers={"x-api-key": server.keys["a"]}, timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])


@pytest.mark.parametrize("route", ROUTES)
def test_gates_per_route(server, route):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(server.base_url + route, json=body, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = httpx.post(server.base_url + route, json=body, timeout=60, headers={"x-api-key": "sk-wrong"})
    assert bad.status_code == 401 and bad.json()["type"] == "error"
    limited = {"x-api-key": server.keys[route]}
    assert httpx.post(server.base_url + route, json={}, timeout=60, headers=limited).status_code == 400
    r = httpx.post(server.base_url + route, json=body, timeout=60, headers=limited)
    assert r.status_code == 429 and r.json() == {"type": "error", "error": {
        "type": "rate_limit_error", "message": r.json()["error"]["message"]}} and r.headers["retry-after"]
    with pytest.raises(anthropic.RateLimitError):
        client(server, route).messages.count_tokens(model=MODEL, messages=body["messages"])


def test_moderation_and_usage(server):
    c = client(server, "usage")
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "I will stab him tonight"}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "moderation" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError), c.messages.stream(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "I will stab him tonight"}]):
        pass
    m1 = c.messages.create(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Hi"}])
    with c.messages.stream(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Hello"}]) as s:
        m2 = s.get_final_message()
    [row] = KeyStore(server.data_dir / "kvserve.db").usage("usage")
    assert row["requests"] == 2
    assert row["completion_tokens"] == m1.usage.output_tokens + m2.usage.output_tokens
    assert row["prompt_tokens"] == sum(m.usage.input_tokens + m.usage.cache_read_input_tokens for m in (m1, m2))


def test_output_moderation_cut_is_a_refusal(server):
    c = client(server, "out")
    m = c.messages.create(model=MODEL, max_tokens=48, extra_body={"temperature": 0}, messages=ECHO)
    assert m.stop_reason == "refusal"
    with c.messages.stream(model=MODEL, max_tokens=48, extra_body={"temperature": 0}, messages=ECHO) as s:
        final = s.get_final_message()
    assert final.stop_reason == "refusal" and [b.type for b in final.content] == [b.type for b in m.content]
    assert "zanzibar zanzibar zanzibar zanzibar" not in final.content[-1].text

