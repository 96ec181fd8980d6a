"""The one generation path as the official `openai` client reads it: chat and completions
(streamed and whole), Responses (create and stream), an arena answer (model name hidden) and a
semantic-cache hit (streamed and whole) all come out of build_plan + run_generation + their API's
renderer; and the lease gives a request's slot and tokens back exactly once, on success, on an
error and when the client hangs up. A tiny random model in this process keeps it fast."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from servers import InProcessServer

from kvserve.server.generation import Lease, run_generation
from kvserve.server.generation import run as run_module
from kvserve.server.routing.semantic_cache import Entry, Hit
from kvserve.server.settings import ServerSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from ggufmaker import make_tiny_llama_gguf

CLIENT_HEADER = {"x-kvserve-client": "tester-0001"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("genpath")
    tiny = make_tiny_llama_gguf(root / "tiny.gguf", ctx=1024)
    settings = ServerSettings(model=str(tiny), served_model_name="tiny", data_dir=root, semantic_cache=False)
    with InProcessServer(settings) as s:
        deadline = time.monotonic() + 120
        while httpx.get(s.base_url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the tiny model did not load"
            time.sleep(0.1)
        yield s


@pytest.fixture
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture
def leases(monkeypatch) -> list[list[int]]:
    """Every lease of the test, with the status of each time it really gave its holdings back."""
    seen: list[list[int]] = []
    account = Lease._account

    async def counted(self: Lease, status: int) -> None:
        if not hasattr(self, "_accounted"):
            self._accounted = []
            seen.append(self._accounted)
        self._accounted.append(status)
        await account(self, status)

    monkeypatch.setattr(Lease, "_account", counted)
    return seen


@pytest.fixture
def runs(monkeypatch) -> list[str]:
    """The plan ids run_generation ran (cached answers included)."""
    ran: list[str] = []

    async def spy(gw, gen, lease):
        ran.append(gen.id)
        async for event in run_generation(gw, gen, lease):
            yield event

    for module in ("kvserve.server.api.openai", "kvserve.server.api.responses", "kvserve.server.generation.run"):
        monkeypatch.setattr(f"{module}.run_generation", spy)
    return ran


def settle(srv) -> None:
    deadline = time.monotonic() + 10
    while srv.state.admission.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.state.admission.running == 0


MESSAGES = [{"role": "user", "content": "Say something."}]


def test_chat_whole_and_streamed(client, srv, runs, leases):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0)
    assert whole.object == "chat.completion" and whole.model == "tiny" and whole.id.startswith("chatcmpl-")
    assert whole.usage.completion_tokens == 6 and whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-2].choices[0].finish_reason == "length"
    assert len(runs) == 2 and [r[0] for r in leases] == [200, 200]
    settle(srv)


def test_completions_whole_and_streamed(client, runs):
    whole = client.completions.create(model="tiny", prompt="Once upon", max_tokens=5, temperature=0, echo=True,
                                      logprobs=2)
    assert whole.object == "text_completion" and whole.choices[0].text.startswith("Once upon")
    assert len(whole.choices[0].logprobs.tokens) == len(whole.choices[0].logprobs.token_logprobs)
    streamed = list(client.completions.create(model="tiny", prompt=["Once upon", "A"], max_tokens=5,
                                              temperature=0, stream=True))
    by_index: dict[int, str] = {}
    for c in streamed:
        for ch in c.choices:
            by_index[ch.index] = by_index.get(ch.index, "") + ch.text
    assert set(by_index) == {0, 1} and by_index[0] == whole.choices[0].text[len("Once upon"):]
    assert len(runs) == 2


def test_responses_create_and_stream(client, runs, leases):
    r = client.responses.create(model="tiny", input="Hello there.", max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.status == "incomplete" and r.model == "tiny"
    assert r.usage.output_tokens == 6 and client.responses.retrieve(r.id).output_text == r.output_text
    events = list(client.responses.create(model="tiny", input="Hello there.", max_output_tokens=6, temperature=0,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert len(runs) == 2 and [s[0] for s in leases] == [200, 200]


def test_arena_answer_hides_the_model(srv, runs):
    url = srv.base_url + "/v1/kvserve/arena"
    battle = httpx.post(url + "/battles", json={"prompt": "Name a colour."}, headers=CLIENT_HEADER).json()
    with httpx.stream("POST", f"{url}/battles/{battle['id']}/answers/b", headers=CLIENT_HEADER, timeout=60) as r:
        assert r.status_code == 200
        body = r.read()
    assert b"tiny" not in body
    stream = openai.Stream(cast_to=openai.types.chat.ChatCompletionChunk, client=openai.OpenAI(api_key="x"),
                           response=httpx.Response(200, content=body, request=r.request))
    chunks = list(stream)
    assert chunks and {c.model for c in chunks} == {"arena-b"} and chunks[-1].choices[0].finish_reason
    assert len(runs) == 1


@pytest.fixture
def cached(srv, monkeypatch):
    """Every lookup hits a stored answer."""
    entry = Entry(id="e1", partition="p", query="What is the capital of Italy?", vector=None,
                  answer="The capital of Italy is Rome, a city of many hills and fountains and a very long "
                         "history of emperors, popes and painters.", finish_reason="stop", prompt_tokens=12,
                  completion_tokens=30, created=time.time(), last_used=time.time())

    async def from_cache(req, kind, model_name, key_name, capped, query=None, moderation=None):
        return Hit(entry, 0.97), None     # (None: the cache's `verify` is off, the stored text is served)

    monkeypatch.setattr(srv.state.routing, "from_cache", from_cache)
    return entry


def test_semantic_cache_hit_whole_and_streamed(client, srv, cached, runs, leases):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=6, extra_body={"kvserve_trace": True})
    whole = raw.parse()
    assert raw.headers["x-kvserve-cache"] == "semantic" and whole.model_extra["kvserve_cache"] == "semantic"
    assert whole.choices[0].message.content == cached.answer and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == 30 and whole.usage.model_extra["kvserve_compute_tokens"] == 0
    assert whole.model_extra["kvserve_trace"]["semantic_cache"]["matched_query"] == cached.query
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"kvserve_trace": True}))
    assert all(c.model_extra["kvserve_cache"] == "semantic" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cached.answer
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 2   # pieces of 16 words
    assert chunks[-2].model_extra["kvserve_trace"]["semantic_cache"]["similarity"] == 0.97
    assert chunks[-1].usage.model_extra["kvserve_compute_tokens"] == 0
    text = client.completions.create(model="tiny", prompt="x", max_tokens=6).choices[0].text
    assert text == cached.answer
    assert len(runs) == 3 and [s[0] for s in leases] == [200, 200, 200]
    assert srv.state.admission.running == 0


def test_lease_released_once_on_client_disconnect(srv, leases):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break      # hang up after the first event
    deadline = time.monotonic() + 10
    while not leases or not leases[0]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    settle(srv)
    time.sleep(0.2)        # the response's background release, if any, has run by now
    assert leases == [[499]]


def test_lease_released_once_on_an_engine_error(srv, leases, monkeypatch):
    async def broken(gen, lease):
        lease.started = True
        raise RuntimeError("the engine fell over")
        yield  # an async generator that never yields

    monkeypatch.setattr(run_module, "_engine_outputs", broken)
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[-2][6:])["error"]["code"] == "internal_error" and lines[-1] == "data: [DONE]"
    whole = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4})
    assert whole.status_code == 500
    settle(srv)
    assert leases == [[500], [500]]


def test_a_tool_call_cut_off_by_max_tokens_finishes_with_length():
    """OpenAI reports a call that max_tokens cut off as "length" (its arguments are not complete
    JSON); a complete one as "tool_calls"."""
    from kvserve.server.api.openai_wire import finish_reason

    call = [object()]
    assert finish_reason("length", call) == "length"
    assert finish_reason("stop", call) == "tool_calls"
    assert finish_reason("stop") == "stop" and finish_reason(None) is None
