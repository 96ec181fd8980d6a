"""Speculative decoding through the API (issue 16), with the engine in its own process so the
per-request opt-out and the drafted-token counts cross the msgpack boundary:

- `kvserve serve --speculative ngram`: a grounded greedy answer is the same with and without
  `"speculative": false`, streamed or not; its `kvserve_trace` marks accepted draft tokens
  (`"drafted": true`), the opted-out one has none;
- /metrics: the spec_decode counters and the acceptance-length histogram, which the opted-out
  request does not move;
- bad options (unknown proposer, K outside 1..16) end `kvserve serve` with one line, exit 2.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from servers import free_port
from test_serve_cli import serve

PASSAGE = ("The river town of Lowbridge was founded in 1821 by a group of millers who needed the fast water of "
           "the Fenn to turn their wheels. Over the next century the town grew around three mills, a stone bridge "
           "and a market square, and by 1900 it had a railway station, two schools and a small hospital.")


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_server):
    return model_server(tmp_path_factory.mktemp("spec"), "--speculative", "ngram", "--num-speculative-tokens", "6",
                        engine="process")


def body(**kw) -> dict:
    return {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Repeat this passage word for word:\n\n" + PASSAGE}],
            "temperature": 0, "max_tokens": 60, "kvserve_trace": True, **kw}


def metric(text: str, name: str) -> float:
    m = re.search(rf"^kvserve:{name}(?:_total)?\{{[^}}]*\}} ([0-9.e+]+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def stream_content(url: str, b: dict) -> tuple[str, dict]:
    text, trace = "", None
    with httpx.stream("POST", url + "/v1/chat/completions", json={**b, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for c in chunk.get("choices", []):
                    text += c["delta"].get("content") or ""
                trace = chunk.get("kvserve_trace") or trace
    return text, trace


def test_drafted_tokens_in_trace_and_metrics_and_opt_out(server):
    url = server.base_url
    r = httpx.post(url + "/v1/chat/completions", json=body(), timeout=300)
    assert r.status_code == 200, r.text
    on = r.json()
    drafted = [t["drafted"] for t in on["kvserve_trace"]["output_tokens"]]
    assert sum(drafted) > 10, drafted
    m1 = httpx.get(url + "/metrics").text
    assert metric(m1, "spec_decode_num_accepted_tokens") >= sum(drafted)
    assert metric(m1, "spec_decode_num_drafts") > 0
    assert 'kvserve:spec_decode_acceptance_length_bucket{le="+Inf"' in m1

    r = httpx.post(url + "/v1/chat/completions", json=body(speculative=False), timeout=300)
    off = r.json()
    assert off["choices"][0]["message"]["content"] == on["choices"][0]["message"]["content"]
    assert not any(t["drafted"] for t in off["kvserve_trace"]["output_tokens"])
    m2 = httpx.get(url + "/metrics").text
    assert metric(m2, "spec_decode_num_draft_tokens") == metric(m1, "spec_decode_num_draft_tokens")

    text, trace = stream_content(url, body())
    assert text == on["choices"][0]["message"]["content"]
    assert any(t["drafted"] for t in trace["output_tokens"])


def test_bad_speculative_value_in_body_is_a_400(server):
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body(speculative="maybe"), timeout=60)
    assert r.status_code == 400 and "speculative" in r.text


@pytest.mark.parametrize("args, message", [(("--speculative", "medusa"), "unknown speculative proposer"),
                                           (("--speculative", "ngram", "--num-speculative-tokens", "17"), "1 to 16"),
                                           (("--num-speculative-tokens", "0"), "1 to 16")])
def test_bad_options_end_serve_with_one_line(tmp_path, args, message):
    r = serve(tmp_path, "--port", str(free_port()), *args, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr
