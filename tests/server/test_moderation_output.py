"""Output moderation with redaction on, against the real model: a schema's email field stays valid
(issue 48), and issue 49's grammar-forced growing secret completes while the server stays
responsive (finding 2)."""

from __future__ import annotations

import json
import re
import threading

import httpx
import jsonschema
import pytest

SCHEMA = {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{2,8}@example\\.com$"}},
          "required": ["email"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_server):
    data_dir = tmp_path_factory.mktemp("moderation-output")
    config = data_dir / "moderation.json"
    config.write_text(json.dumps({"pii_output": "redact"}))        # every answer redacted unless constrained
    return model_server(data_dir, "--moderation-config", str(config))


def chat(server, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=600)


@pytest.mark.parametrize("stream", [False, True])
def test_schema_answers_stay_valid_with_redaction_on(server, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "contact", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        body = {"messages": [{"role": "user", "content": "Give the support team's e-mail address as JSON."}],
                "response_format": fmt, "max_tokens": 48, "temperature": 0.8, "seed": seed, "stream": stream,
                "kvserve_trace": not stream, "kvserve_moderation": {"pii_output": "redact"}}
        r = chat(server, body)
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
            content = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        else:
            content = r.json()["choices"][0]["message"]["content"]
            checks = r.json()["kvserve_trace"]["moderation"]
            assert {"check": "pii_output", "action": "skipped", "reason": "structured output"} in checks
        jsonschema.validate(json.loads(content), SCHEMA)          # an address, never "[EMAIL]"
    plain = chat(server, {"messages": [{"role": "user", "content": "Repeat exactly: write to bob@example.com"}],
                          "max_tokens": 24, "temperature": 0}).json()["choices"][0]["message"]["content"]
    assert "bob@example.com" not in plain                           # without a grammar the policy redacts


def test_a_grammar_forced_secret_completes_and_the_server_stays_responsive(server):
    """Issue 49's hostile request (`guided_regex: "sk-[a-z]+"` under a redaction policy) used to
    rescan its whole tail every token; under a grammar nothing is redacted now (the answer matches
    its regex), and the redactor's own bound is tested in tests/safety/test_pii_cost.py and
    test_moderation_stage.py. /health and a short chat are answered meanwhile."""
    seen: list[int] = []
    done = threading.Event()

    def bystander():
        with httpx.Client(base_url=server.base_url, timeout=300) as c:
            while not done.is_set():
                seen.append(c.get("/health").status_code)
                seen.append(c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).status_code)

    t = threading.Thread(target=bystander)
    t.start()
    try:
        body = {"prompt": "The key is", "guided_regex": "sk-[a-z]+", "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True, "kvserve_moderation": {"pii_output": "redact"}}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=900) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finally:
        done.set()
        t.join()
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert re.fullmatch(r"sk-[a-z]+", text) and len(text) > 256, text[:80]
    assert seen and set(seen) == {200}
