"""Request fields whose per-token cost grows with their size are capped where OpenAI caps them
(a 400 naming the field), and honest values still work: stop strings (count and length),
logit_bias entries, and a grammar's size."""

from __future__ import annotations

import httpx
import pytest

HTTP = httpx.Client(timeout=600)
MSG = [{"role": "user", "content": "Count from one to ten in words."}]


@pytest.fixture(scope="module")
def srv(hardened_server):
    return hardened_server


def post(srv, **body) -> httpx.Response:
    return HTTP.post(srv.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {srv.keys['a']}"},
                     json={"messages": MSG, "max_tokens": 24, "temperature": 0, **body})


@pytest.mark.parametrize("extra,param", [
    ({"stop": ["x" * 60_000] * 16}, "stop"),              # the case: sixteen 60 KB stops
    ({"stop": "y" * 1025}, "stop"),
    ({"stop": ["ok"] * 17}, "stop"),
    ({"logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias"),
    ({"logit_bias": {str(t): -1 for t in range(49152)}, "n": 8}, "logit_bias"),   # vocabulary-wide
    ({"guided_choice": [f"opt{i}" for i in range(40_000)]}, "guided_choice"),
])
def test_costly_fields_beyond_their_cap_are_400(srv, extra, param):
    r = post(srv, **extra)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == param


def test_honest_values_at_the_caps_are_served(srv):
    plain = post(srv).json()["choices"][0]["message"]["content"]
    assert len(plain) >= 20
    stop = plain[len(plain) // 3:len(plain) // 3 + 7]      # spans tokens
    r = post(srv, stop=["z" * 1024] * 15 + [stop])
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == plain[:plain.index(stop)] and choice["finish_reason"] == "stop"
    r = post(srv, logit_bias={str(t): 0 for t in range(300)})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain
