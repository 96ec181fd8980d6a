"""The Responses API with the official `openai` client against the real model: create, stored
history through previous_response_id, streaming events, function tools and their outputs,
text.format, retrieve/delete per key, and token-budgeted truncation of the context."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from servers import make_keys

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_server):
    data_dir = tmp_path_factory.mktemp("responses")
    keys = make_keys(data_dir, "a", "b")
    srv = model_server(data_dir, "--max-model-len", "512")
    srv.keys = keys
    return srv


def client(server, key: str = "a") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.keys[key], max_retries=0)


def test_create_then_continue_with_previous_response_id(server):
    c = client(server)
    first = c.responses.create(model=c.models.list().data[0].id, input="My name is Zoltan. Say hi.", instructions="Be brief.",
                               max_output_tokens=12, temperature=0)
    assert first.object == "response" and first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert first.output_text and first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    second = c.responses.create(input="What is my name?", previous_response_id=first.id, max_output_tokens=8,
                                temperature=0, instructions="Answer with one word.",
                                extra_body={"kvserve_trace": True})
    prompt = second.model_extra["kvserve_trace"]["prompt_text"]
    assert "Zoltan" in prompt and first.output_text.strip()[:20] in prompt     # the stored history
    assert "Answer with one word." in prompt and "Be brief." not in prompt    # only the new instructions
    assert second.previous_response_id == first.id
    again = c.responses.retrieve(second.id)
    assert again.id == second.id and again.output_text == second.output_text
    with pytest.raises(openai.NotFoundError):
        client(server, "b").responses.retrieve(second.id)       # stored per key
    c.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(second.id)


def test_streaming_events(server):
    c = client(server)
    events = list(c.responses.create(input="Count from one to five.", max_output_tokens=16, temperature=0,
                                     stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    for k in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
              "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert k in kinds, k
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens > 0
    assert c.responses.retrieve(final.id).output_text == text       # stored after the stream


def test_function_tools_and_their_outputs(server):
    c = client(server)
    r = c.responses.create(input="What's the weather in Paris?", tools=[WEATHER], max_output_tokens=48,
                           tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    follow = c.responses.create(previous_response_id=r.id, tools=[WEATHER], max_output_tokens=16, temperature=0,
                                input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                        "output": "Sunny, 24 C"}], extra_body={"kvserve_trace": True})
    assert "Sunny, 24 C" in follow.model_extra["kvserve_trace"]["prompt_text"]
    assert follow.output_text is not None


def test_text_format_json_schema(server):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    r = client(server).responses.create(input="Name a city in France.", max_output_tokens=40, temperature=0,
                                        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                         "strict": True}})
    assert isinstance(json.loads(r.output_text)["city"], str)


def test_truncation_keeps_system_and_latest_turn(server):
    turns = []
    for i in range(8):
        turns += [{"role": "user", "content": f"Story part {i}: " + "the cat walked along the wall " * 8},
                  {"role": "assistant", "content": "Noted."}]
    turns.append({"role": "user", "content": "Now say OK."})
    body = {"input": turns, "instructions": "You are terse.", "max_output_tokens": 8}
    h = {"Authorization": f"Bearer {server.keys['a']}"}
    r = httpx.post(server.base_url + "/v1/responses", json=body, headers=h, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(server.base_url + "/v1/responses", json={**body, "truncation": "auto", "kvserve_trace": True},
                   headers=h, timeout=120)
    assert r.status_code == 200, r.text
    tr = r.json()["kvserve_trace"]
    assert tr["context"]["dropped_messages"] > 0 and tr["context"]["prompt_tokens"] <= 512 - 8
    assert "You are terse." in tr["prompt_text"] and "Now say OK." in tr["prompt_text"]
    assert "Story part 0" not in tr["prompt_text"]


def test_flagged_input_is_blocked_before_the_engine(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).responses.create(input="I am going to stab him tonight", max_output_tokens=8)
    assert e.value.code == "content_policy_violation"


def test_bad_input_is_a_clear_400(server):
    h = {"Authorization": f"Bearer {server.keys['a']}"}
    for body, param in (({"input": 3}, "input"), ({"input": [{"type": "image"}]}, "input[0].type"),
                        ({"input": "hi", "bogus": 1}, "bogus"), ({"input": "hi", "previous_response_id": "resp_x"},
                                                                "response_id")):
        r = httpx.post(server.base_url + "/v1/responses", json=body, headers=h, timeout=30)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
