"""The OpenAI-compatible API against a real server with the real default model.

One server for the module per engine client (`python -m kvserve.server serve` on a free port,
context window capped at 512 so the truncation test stays cheap; once in-process, once with
`--engine-process`); keys are created before it starts.
Small max_tokens everywhere: this module must stay within a few minutes on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from kvserve.server.stores.keys import KeyStore

HELLO = [{"role": "user", "content": "Name a colour."}]
MODEL = ""  # the served model's name, set by the srv fixture
HTTP = httpx.Client(timeout=300)  # the CPU is shared: generous timeouts, never timing assertions


@pytest.fixture(scope="module")
def srv(tmp_path_factory, model_server, engine_kind):
    data_dir = tmp_path_factory.mktemp(f"api-{engine_kind}")
    store = KeyStore(data_dir / "kvserve.db")
    keys = {"alice": store.create("alice"), "tiny": store.create("tiny", rpm=2),
            "tokens": store.create("tokens", tpm=1000)}
    store.close()
    server = model_server(data_dir, "--max-model-len", "512", "--max-running", "64", engine=engine_kind)
    server.keys = keys
    global MODEL
    MODEL = HTTP.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {keys['alice']}"}
                      ).json()["data"][0]["id"]
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=srv.keys["alice"], max_retries=0)


def auth(srv, name="alice") -> dict:
    return {"Authorization": f"Bearer {srv.keys[name]}"}


def metrics(srv) -> dict[str, float]:
    text = HTTP.get(srv.base_url + "/metrics", headers=auth(srv)).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_health_names_the_engine_client(srv):
    """`serve --engine-process` reaches make_engine_client: /health says which client serves."""
    body = HTTP.get(srv.base_url + "/health").json()
    assert body["status"] == "ok" and body["engine"] == srv.engine


def test_models_tokenize_detokenize(srv, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [models.data[0].id, "all-minilm-l6-v2"]   # the model, the embedder
    name = models.data[0].id
    r = HTTP.post(srv.base_url + "/tokenize", json={"prompt": "Hello world", "model": name}, headers=auth(srv))
    ids = r.json()["tokens"]
    assert r.status_code == 200 and r.json()["count"] == len(ids) > 0
    r = HTTP.post(srv.base_url + "/detokenize", json={"tokens": ids}, headers=auth(srv))
    assert r.json()["prompt"].endswith("Hello world")


def test_sync_chat_n2_logprobs_validates(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=6, n=2, seed=1,
        logprobs=True, top_logprobs=3, temperature=0.8)
    body = json.loads(raw.text)
    resp = ChatCompletion.model_validate(body)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert [c.index for c in resp.choices] == [0, 1]
    total = 0
    for c in resp.choices:
        assert c.finish_reason in ("stop", "length") and c.message.role == "assistant"
        entries = c.logprobs.content
        assert 1 <= len(entries) <= 6
        assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
        total += len(entries)
    assert resp.usage.completion_tokens == total
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + total


def test_sync_chat_stream_include_usage_matches_non_stream(client):
    kw = {"messages": HELLO, "max_tokens": 8, "temperature": 0}
    full = client.chat.completions.create(model=MODEL, **kw)
    chunks = list(client.chat.completions.create(model=MODEL, **kw, stream=True,
                                                 stream_options={"include_usage": True}))
    for ch in chunks:
        ChatCompletionChunk.model_validate(ch.model_dump())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_async_completions_stream_and_not(srv):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key=srv.keys["alice"], max_retries=0)
        raw = await aclient.completions.with_raw_response.create(
            model=MODEL, prompt=["Once upon a time", "The sky is"],
            max_tokens=5, temperature=0, logprobs=2)
        resp = Completion.model_validate(json.loads(raw.text))
        stream = await aclient.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await aclient.close()
        return resp, chunks

    resp, chunks = asyncio.run(run())
    assert resp.object == "text_completion" and [c.index for c in resp.choices] == [0, 1]
    for c in resp.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
        assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed and chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens > 0
    final = Completion.model_validate(chunks[-2].model_dump())  # the chunk with finish_reason
    assert final.choices[0].finish_reason in ("stop", "length")
    if final.choices[0].finish_reason == "length":
        assert chunks[-1].usage.completion_tokens == 5


def test_echo_logprobs_for_loglikelihood(client):
    """The request lm-evaluation-harness's local-completions sends to score a continuation."""
    resp = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = resp.choices[0].logprobs
    n_prompt = resp.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 1 and lp.token_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert resp.choices[0].text.startswith("The capital of France is")
    assert "".join(lp.tokens[:n_prompt]) == "The capital of France is"


def test_prompt_of_token_ids_is_one_prompt_of_any_length(srv, client):
    """`prompt: [ids]` is one tokenized prompt however long (not len(ids) prompts; the 32-prompt cap
    once rejected any token prompt past 32 ids), and it answers as its text does."""
    text = ("The lighthouse keeper climbed the stairs every evening, counted the steps, lit the lamp, "
            "checked the oil, wiped the salt from the glass, listened to the foghorn across the bay "
            "and wrote the weather in a small book before supper.")
    ids = HTTP.post(srv.base_url + "/tokenize", json={"prompt": text}, headers=auth(srv)).json()["tokens"]
    assert len(ids) > 32
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0)
    assert len(by_ids.choices) == 1 and by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text
    two = client.completions.create(model=MODEL, prompt=[ids, ids[:10]], max_tokens=2, temperature=0)
    assert len(two.choices) == 2


def test_errors_401_404_400(srv, client):
    url = srv.base_url + "/v1/chat/completions"
    r = HTTP.post(url, json={"messages": HELLO})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=HELLO, max_tokens=2)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    bad = [({"max_tokens": 600}, "messages", "context_length_exceeded"), ({"min_p": 2}, "min_p", None),
           ({"top_p": 0}, "top_p", None), ({"presence_penalty": 9}, "presence_penalty", None),
           ({"logit_bias": {"x": 1}}, "logit_bias", None), ({"extra": 1}, "extra", None)]
    for extra, param, code in bad:
        r = HTTP.post(url, json={"messages": HELLO, "max_tokens": 4, **extra}, headers=auth(srv))
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.text)
        if code:
            assert r.json()["error"]["code"] == code
    r = HTTP.post(srv.base_url + "/v1/completions", json={"prompt": [10**9], "max_tokens": 2}, headers=auth(srv))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_429_request_and_token_buckets(srv):
    url = srv.base_url + "/v1/chat/completions"
    body = {"messages": HELLO, "max_tokens": 1}
    codes = [HTTP.post(url, json=body, headers=auth(srv, "tiny")) for _ in range(3)]
    assert [r.status_code for r in codes[:2]] == [200, 200]
    assert codes[2].status_code == 429 and int(codes[2].headers["retry-after"]) >= 1
    assert codes[2].headers["x-should-retry"] == "true" and codes[2].json()["error"]["code"] == "rate_limit_exceeded"
    # prompt + max_tokens * n beyond the key's whole bucket: waiting cannot help
    r = HTTP.post(url, json={"messages": HELLO, "max_tokens": 200, "n": 8}, headers=auth(srv, "tokens"))
    assert r.status_code == 429 and r.headers["x-should-retry"] == "false" and r.json()["error"]["param"]
    # reservation and refund: 1000 tokens/min; each request reserves prompt + 450 but stops at the
    # first space, so three in a row fit only because the unused reservation comes back. Greedy: at
    # temperature 1 an answer in a script without spaces (CJK) now and then runs past 50 tokens.
    for _ in range(3):
        r = HTTP.post(url, json={"messages": HELLO, "max_tokens": 450, "stop": [" ", ".", "\n"], "temperature": 0},
                      headers=auth(srv, "tokens"))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] < 50


def test_truncate_oldest(srv, client):
    turns = []
    for i in range(12):
        turns.append({"role": "user" if i % 2 == 0 else "assistant",
                      "content": f"Turn {i}: " + "lorem ipsum dolor sit amet " * 12})
    messages = [{"role": "system", "content": "Be brief."}, *turns, {"role": "user", "content": "Say hi."}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4,
                                                           extra_body={"truncate": "oldest"})
    resp = raw.parse()
    assert int(raw.headers["x-kvserve-truncated-messages"]) > 0
    assert resp.usage.prompt_tokens + 4 <= 512


def test_trace_nonstream_and_stream(srv, client):
    kw = {"messages": [{"role": "system", "content": "You are terse. " * 10}, *HELLO], "max_tokens": 5,
          "temperature": 0, "extra_body": {"kvserve_trace": True}}
    first = json.loads(client.chat.completions.with_raw_response.create(model=MODEL, **kw).text)
    second = json.loads(client.chat.completions.with_raw_response.create(model=MODEL, **kw).text)
    for body in (first, second):
        tr = body["kvserve_trace"]
        assert body["choices"][0]["logprobs"] is None  # internal logprobs are not leaked
        assert tr["request_id"] == body["id"] and tr["prompt_text"].endswith("assistant\n")
        assert len(tr["prompt_tokens"]) == tr["prompt_token_count"] == body["usage"]["prompt_tokens"]
        assert len(tr["output_tokens"]) == tr["completion_token_count"] == body["usage"]["completion_tokens"]
        for tok in tr["output_tokens"]:
            assert len(tok["top"]) == 5 and 0 <= tok["prob"] <= 1 and tok["top"][0]["prob"] >= tok["top"][-1]["prob"]
        t = tr["timings_ms"]
        assert t["ttft"] <= t["total"] and all(v >= 0 for v in t.values())
        assert tr["kv_blocks_used"] >= 1 and tr["block_size"] >= 1
    tr2 = second["kvserve_trace"]
    assert tr2["cached_prompt_tokens"] > 0
    assert tr2["cached_prompt_tokens"] == second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert sum(t["cached"] for t in tr2["prompt_tokens"]) == tr2["cached_prompt_tokens"]
    stream = client.chat.completions.create(model=MODEL, **kw, stream=True)
    traced = [c for c in stream if getattr(c, "kvserve_trace", None)]
    assert len(traced) == 1 and traced[0].choices[0].finish_reason is not None


def test_fifty_concurrent_streams_usage(srv, client):
    prompt_tokens = HTTP.post(srv.base_url + "/tokenize", json={"messages": HELLO},
                               headers=auth(srv)).json()["count"]

    async def one(aclient, i):
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=6, stream=True, seed=i, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True})
        pieces, usage, finish = 0, None, None
        async for c in stream:
            if c.choices and c.choices[0].delta.content:
                pieces += 1
            if c.choices and c.choices[0].finish_reason:
                finish = c.choices[0].finish_reason
            if c.usage:
                usage = c.usage
        return pieces, usage, finish

    async def run():
        aclient = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key=srv.keys["alice"], max_retries=0,
                                     timeout=300)
        try:
            return await asyncio.gather(*(one(aclient, i) for i in range(50)))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert len(results) == 50
    for pieces, usage, finish in results:
        assert finish == "length" and usage.completion_tokens == 6 and usage.prompt_tokens == prompt_tokens
        assert 1 <= pieces <= 6


def wait_idle(srv, timeout=60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(srv)
        if m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.2)


def test_hangups_free_kv_blocks(srv):
    async def hang_up(http: httpx.AsyncClient, i: int) -> None:
        body = {"messages": HELLO, "max_tokens": 300, "ignore_eos": True, "stream": True, "seed": i}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    seen += 1
                    if seen == 2:
                        return  # leaving the block closes the connection mid-stream

    async def run():
        async with httpx.AsyncClient(base_url=srv.base_url, headers=auth(srv), timeout=120) as http:
            await asyncio.gather(*(hang_up(http, i) for i in range(20)))

    asyncio.run(run())
    m = wait_idle(srv)
    assert m["kvserve:kv_cache_usage_perc"] == 0
    assert m["kvserve:kv_cache_blocks_used"] == 0


def test_metrics_ttft_count_equals_requests_served(srv, client):
    before = defaultdict(float, wait_idle(srv))   # a labelled counter has no sample before its first request
    for i in range(3):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, seed=i)
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    after = metrics(srv)
    served = after["kvserve:request_success_total"] - before["kvserve:request_success_total"]
    assert served == 4
    assert after["kvserve:time_to_first_token_seconds_count"] - before["kvserve:time_to_first_token_seconds_count"] \
        == served
    assert after["kvserve:e2e_request_latency_seconds_count"] - before["kvserve:e2e_request_latency_seconds_count"] \
        == served
    assert after["kvserve:generation_tokens_total"] > before["kvserve:generation_tokens_total"]
    for name in ("inter_token_latency_seconds_count", "request_queue_time_seconds_count", "prompt_tokens_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total"):
        assert "kvserve:" + name in after


def step_profile(srv) -> tuple[dict[str, float], dict[str, float]]:
    """(phase -> seconds, counter -> value) from /metrics."""
    phases: dict[str, float] = {}
    counters: dict[str, float] = {}
    for fam in text_string_to_metric_families(HTTP.get(srv.base_url + "/metrics", headers=auth(srv)).text):
        for s in fam.samples:
            if fam.name == "kvserve:phase_seconds":
                phases[s.labels["phase"]] = s.value
            elif fam.name in ("kvserve:engine_steps", "kvserve:batched_tokens", "kvserve:batched_requests"):
                counters[fam.name] = s.value
    return phases, counters


def test_metrics_step_profile(srv, client):
    """The step profile on /metrics: every engine phase, the client's output processing and the
    handler's HTTP time grow with a streamed and a plain request, and so do the step counters."""
    wait_idle(srv)
    ph0, c0 = step_profile(srv)
    assert {"schedule", "prepare", "forward", "logits", "sample", "update", "messages", "output", "http"} <= set(ph0)
    for _ in client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, stream=True, seed=1):
        pass
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, seed=2)
    ph1, c1 = step_profile(srv)
    for phase in ("schedule", "prepare", "forward", "logits", "sample", "update", "output", "http"):
        assert ph1[phase] > ph0[phase], phase
    steps = c1["kvserve:engine_steps"] - c0["kvserve:engine_steps"]
    assert steps >= 4                                    # at least one prefill and three decodes
    assert c1["kvserve:batched_tokens"] - c0["kvserve:batched_tokens"] >= steps
    assert c1["kvserve:batched_requests"] - c0["kvserve:batched_requests"] >= steps


def test_access_log_and_ledger(srv, client):
    rid = "test-log-line-1"
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                   extra_headers={"x-request-id": rid})
    deadline = time.monotonic() + 10
    while not (lines := [json.loads(x) for x in srv.access_log() if rid in x]) and time.monotonic() < deadline:
        time.sleep(0.1)
    (line,) = lines
    assert line["status"] == 200 and line["key_name"] == "alice" and line["prompt_tokens"] > 0
    for field in ("model", "completion_tokens", "cached_tokens", "queue_ms", "ttft_ms", "tokens_per_s",
                  "total_ms", "finish_reason"):
        assert field in line
    usage = {r["key_name"]: r for r in KeyStore(srv.data_dir / "kvserve.db").usage()}
    assert usage["alice"]["requests"] >= 5 and usage["alice"]["completion_tokens"] > 0
