"""Moderation end to end with the real model: /v1/moderations, the input gate before the queue,
output moderation cutting a stream, PII redaction, per-key policies (keys CLI), the trace."""

from __future__ import annotations

import json
import re
import time

import gguf
import httpx
import pytest
from typer.testing import CliRunner

from kvserve.model.registry import resolve
from kvserve.server.cli import keys_app
from kvserve.server.stores.keys import KeyStore
from kvserve.tokenizer import Tokenizer

WORD = "zanzibar"
ECHO = "zanzibar zanzibar zanzibar zanzibar zanzibar zanzibar zanzibar zanzibar"


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_server):
    data_dir = tmp_path_factory.mktemp("moderation")
    store = KeyStore(data_dir / "kvserve.db")
    keys = {name: store.create(name) for name in ("default", "plain", "out", "pii", "locked")}
    store.close()
    runner = CliRunner()
    for args in (["plain", "--mode", "off", "--pii-output", "off"],
                 ["out", "--mode", "output", "--check-every", "4", "--block", f"places={WORD}"],
                 ["pii", "--pii-input", "redact"], ["locked", "--no-request-overrides"]):
        r = runner.invoke(keys_app, ["moderation", *args, "--data-dir", str(data_dir)])
        assert r.exit_code == 0, r.output
    listed = runner.invoke(keys_app, ["moderation", "--data-dir", str(data_dir)]).output
    assert "places" in listed and '"mode": "off"' in listed
    # two models (the same weights under two names): a cut answer of the second must end in its own engine
    srv = model_server(data_dir, "--max-model-len", "512", "--model", "smollm2-135m-instruct",
                       "--model", "second=smollm2-135m-instruct")
    srv.keys = keys
    return srv


def post(server, key: str, path: str, body: dict, rid: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.keys[key]}"} | ({"x-request-id": rid} if rid else {})
    return httpx.post(server.base_url + path, json=body, timeout=120, headers=headers)


def metric(server, name: str, having: str = "") -> float:
    r = httpx.get(server.base_url + "/metrics", timeout=10,
                  headers={"Authorization": f"Bearer {server.keys['default']}"})
    assert r.status_code == 200, r.text
    text = r.text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and having in line)


def test_moderations_endpoint_openai_shape(server):
    r = post(server, "default", "/v1/moderations", {"input": ["I will stab him tonight", "kill the process"]})
    assert r.status_code == 200, r.text
    a, b = r.json()["results"]
    assert a["flagged"] and a["categories"]["violence"] and not b["flagged"]
    assert set(a["category_scores"]) >= {"harassment", "hate", "self-harm", "sexual", "violence", "illicit"}
    bad = post(server, "default", "/v1/moderations", {"input": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_flagged_input_never_reaches_the_engine(server):
    before = metric(server, "kvserve:prompt_tokens_total")
    assert before > 0 or post(server, "default", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).is_success
    before = metric(server, "kvserve:prompt_tokens_total")
    assert before > 0
    flagged = metric(server, "kvserve:moderation_flagged_total", 'stage="input"')
    for body, path in (({"messages": [{"role": "user", "content": "how do I murder my boss and hide it"}]},
                        "/v1/chat/completions"),
                       ({"prompt": "I will stab him tonight", "stream": True}, "/v1/completions")):
        r = post(server, "default", path, {**body, "max_tokens": 8}, rid="flagged-" + path.rsplit("/", 1)[-1])
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "content_policy_violation"
    assert metric(server, "kvserve:prompt_tokens_total") == before
    assert metric(server, "kvserve:moderation_flagged_total", 'stage="input"') == flagged + 2
    logged = server.logged(lambda e: e.get("request_id") == "flagged-completions")
    assert logged and logged[-1]["status"] == 400 and logged[-1]["moderation"]["flagged"]
    ok = post(server, "default", "/v1/chat/completions",
              {"messages": [{"role": "user", "content": "How do I kill the process on port 8080?"}],
               "max_tokens": 4, "kvserve_trace": True})
    assert ok.status_code == 200, ok.text
    checks = ok.json()["kvserve_trace"]["moderation"]
    assert checks[0]["check"] == "input" and not checks[0]["flagged"] and checks[0]["ms"] >= 0
    assert checks[-1]["check"] == "output"


def engine_idle(server) -> bool:
    for _ in range(100):
        if metric(server, "kvserve:num_requests_running") == 0 == metric(server, "kvserve:kv_cache_blocks_used"):
            return True
        time.sleep(0.05)
    return False


def offset_tokens(tokens: list[str], word: str) -> int:
    """How many tokens the answer has when `word` is first complete in it."""
    text = ""
    for i, t in enumerate(tokens):
        text += t
        if word in text.lower():
            return i + 1
    raise AssertionError(f"{word!r} never appears in {text!r}")


@pytest.mark.parametrize("stream,model", [(False, None), (True, None), (True, "second")])
def test_violating_output_is_cut_within_one_window(server, stream, model):
    body = {"prompt": ECHO, "max_tokens": 48, "ignore_eos": True, "temperature": 0, "logprobs": 0, **({"model": model} if model else {})}
    full = post(server, "plain", "/v1/completions", body).json()["choices"][0]
    first = offset_tokens(full["logprobs"]["tokens"], WORD)
    generated = metric(server, "kvserve:generation_tokens_total")
    r = post(server, "out", "/v1/completions", {**body, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        choices = [c for e in events for c in e["choices"]]
        text = "".join(c["text"] for c in choices)
        n_tokens = sum(len(c["logprobs"]["tokens"]) for c in choices if c.get("logprobs"))
        finish = [c["finish_reason"] for c in choices if c["finish_reason"]]
    else:
        choice = r.json()["choices"][0]
        text, n_tokens, finish = choice["text"], r.json()["usage"]["completion_tokens"], [choice["finish_reason"]]
    assert finish == ["content_filter"]
    assert n_tokens <= first + 4 < 48          # cut within one check window (4 tokens) of the word
    assert not re.search(r"zanzibar\s+zanzibar\s+zanzibar\s+zanzibar", text)
    assert engine_idle(server)       # aborted in the engine, its blocks freed (the abort lands within a step)
    # ...in the engine that served it: it stopped generating a step or two after the cut
    assert metric(server, "kvserve:generation_tokens_total") - generated <= n_tokens + 8


def test_chat_output_cut_streaming(server):
    ask = {"role": "user", "content": f"Say {WORD} eight times."}
    body = {"messages": [ask, {"role": "assistant", "content": ECHO}, ask],   # the model copies its last answer
            "max_tokens": 48, "temperature": 0, "stream": True}
    plain = post(server, "plain", "/v1/chat/completions", {**body, "stream": False}).json()
    assert WORD in plain["choices"][0]["message"]["content"].lower()
    r = post(server, "out", "/v1/chat/completions", body)
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finish == ["content_filter"] and r.text.rstrip().endswith("data: [DONE]")


def test_pii_redacted_on_input_and_output(server):
    body = {"prompt": "Contact: alice.smith@example.com. Contact: alice.smith@example.com. Contact:",
            "max_tokens": 12, "temperature": 0}
    plain = post(server, "plain", "/v1/completions", body).json()["choices"][0]["text"]
    default = post(server, "default", "/v1/completions", body).json()["choices"][0]["text"]
    redacted = post(server, "default", "/v1/completions",
                    {**body, "kvserve_moderation": {"pii_output": "redact"}}).json()["choices"][0]["text"]
    assert "@example.com" in plain and "@example.com" in default   # greedy: the model repeats the address
    assert "@example.com" not in redacted and "[EMAIL]" in redacted
    tr = post(server, "pii", "/v1/completions", {**body, "kvserve_trace": True}).json()["kvserve_trace"]
    assert "alice.smith" not in tr["prompt_text"] and "[EMAIL]" in tr["prompt_text"]
    assert any(c["check"] == "pii_input" and c["kinds"] == ["email"] for c in tr["moderation"])


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_arguments_are_moderated(server, stream):
    body = {"messages": [{"role": "user", "content": f"What is the weather in {WORD.title()}?"}],
            "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 32, "temperature": 0}
    plain = post(server, "plain", "/v1/chat/completions", body).json()["choices"][0]
    assert WORD in plain["message"]["tool_calls"][0]["function"]["arguments"].lower()   # the call names the place
    r = post(server, "out", "/v1/chat/completions", {**body, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        calls = [c["delta"].get("tool_calls") for e in events for c in e["choices"] if c["delta"].get("tool_calls")]
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    else:
        choice = r.json()["choices"][0]
        calls, finish = choice["message"].get("tool_calls") or [], [choice["finish_reason"]]
    assert finish == ["content_filter"]
    # a stream may have opened the call (its name, before any argument): the arguments never went out
    assert not any(e.get("function", {}).get("arguments") for c in calls for e in (c if stream else [c]))


def test_token_id_prompts_are_moderated(server):
    tok = Tokenizer.from_gguf(gguf.GGUFReader(resolve(None).path))
    bad = tok.encode("I will stab him tonight", add_special_tokens=False)
    fine = tok.encode("The capital of France is", add_special_tokens=False)
    before = metric(server, "kvserve:prompt_tokens_total")
    for prompt in (bad, [fine, bad]):
        r = post(server, "default", "/v1/completions", {"prompt": prompt, "max_tokens": 4})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "content_policy_violation"
    assert metric(server, "kvserve:prompt_tokens_total") == before
    ok = post(server, "default", "/v1/completions", {"prompt": fine, "max_tokens": 2, "kvserve_trace": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["kvserve_trace"]["moderation"][0] == {**ok.json()["kvserve_trace"]["moderation"][0],
                                                           "check": "input", "flagged": False}
    # ids outside the vocabulary are not moderation's to decode: the engine's 400 names them
    for prompt in ([953, -25130, -98793], [fine, [5, 10 ** 9]]):
        r = post(server, "default", "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_annotate_lets_a_flagged_input_through_unless_the_key_forbids_it(server):
    body = {"messages": [{"role": "user", "content": "I will stab him tonight"}], "max_tokens": 2,
            "kvserve_moderation": {"action": "annotate"}}
    r = post(server, "default", "/v1/chat/completions", body, rid="annotated-1")
    assert r.status_code == 200, r.text
    assert r.headers["x-kvserve-moderation"].startswith("flagged; categories=") and "violence" in \
        r.headers["x-kvserve-moderation"]
    (line,) = server.logged(lambda e: e.get("request_id") == "annotated-1")
    assert line["moderation"]["flagged"] and line["moderation"]["action"] == "annotate"
    locked = post(server, "locked", "/v1/chat/completions", body)
    assert locked.status_code == 400 and locked.json()["error"]["param"] == "kvserve_moderation"
    blocked = post(server, "locked", "/v1/chat/completions", {**body, "kvserve_moderation": None})
    assert blocked.status_code == 400 and blocked.json()["error"]["code"] == "content_policy_violation"


def test_redaction_comes_before_the_fit_of_a_truncating_chat(server):
    """With `--pii-input redact`, a long `truncate: "oldest"` chat is fitted to the window on its
    redacted text: a turn that fits only once the secrets are masked is read by the model, so it is
    judged (fitting the unredacted text dropped it from moderation while the model still read it)."""
    import random
    import string
    rng = random.Random(7)

    def secret() -> str:
        return "sk-" + "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(600))

    turns = []
    for i in range(8):      # ~4,900 characters, several thousand tokens unredacted; ~150 once masked
        turns += [{"role": "user", "content": f"Note {i}: my key is {secret()} keep it."},
                  {"role": "assistant", "content": "Noted."}]
    turns.append({"role": "user", "content": "Thanks. How many notes did I send?"})

    def chat(msgs):
        return post(server, "pii", "/v1/chat/completions",
                    {"messages": msgs, "max_tokens": 2, "temperature": 0, "truncate": "oldest"})

    r = chat(turns)
    assert r.status_code == 200, r.text
    assert "x-kvserve-truncated-messages" not in r.headers      # fitted on the masked text: nothing dropped
    harm = [{"role": "user", "content": "Give me a step-by-step plan to stab my landlord and hide the body."},
            {"role": "assistant", "content": "No."}]
    r = chat(harm + turns)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "content_policy_violation"
    assert r.json()["error"]["param"] == "messages[0]"
