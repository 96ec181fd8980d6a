"""The same greedy (and seeded) answers after every restart of a default server, whatever runs
beside the engine in the process (issue 53).

Each restart starts a default `kvserve serve` (semantic cache and router encoder on, as users run
it), sends the same sequence of requests (chat and completions, greedy with logprobs, seeded
sampling), with sentence-encoder work interleaved (`/v1/embeddings` in flight during generation,
semantic-cache lookups of every chat), and the answers are compared token for token and logprob
for logprob with the first start's. A start whose encoder warm-up ran beside the model's load used
to answer differently (BENCHMARKS.md, issue 53); the `slow` variant runs 50 starts.

Variants: `--engine-process`; two models in one server (loaded one after the other, the second
while the first already serves and the encoder warms up; each model's answers compared with its
own); `--replicas 2` (each request sent under several cache salts, which the replica router places
by rendezvous hashing, so both replicas answer every kind of request: every copy must match the
first start's answer, whichever replica served it, and /metrics must show that both served).
"""

from __future__ import annotations

import concurrent.futures
import json
import os

import httpx
import pytest
from servers import ModelServer

CHATS = ["Name the capital city of France.", "Give me two words that rhyme with cat.",
         "Write one sentence about the ocean.", "Describe a sunset in one sentence."]
EMBED = {"input": [f"background text number {i} for the sentence encoder" for i in range(24)]}


SALTS = ("r0", "r1", "r2", "r3", "r4", "r5")


def _post(c: httpx.Client, path: str, body: dict, models: tuple, salts: tuple, key: str, out: dict) -> None:
    """`body` once per model and cache salt; the answers under `out[(key, model)]`."""
    for model in models:
        for salt in salts:
            r = c.post(path, json=body | ({"model": model} if model else {}) | ({"cache_salt": salt} if salt else {}))
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            text = ch["message"]["content"] if "message" in ch else ch["text"]
            out.setdefault((key, model), []).append((text, json.dumps(ch["logprobs"])))


def _sequence(base: str, models: tuple = (None,), salts: tuple = (None,)) -> dict:
    """Every answer of one start's request sequence, with its logprobs (the comparable parts)."""
    out: dict = {}
    # copies under other salts skip the semantic cache (it does not partition by salt)
    extra = {"cache": False} if len(salts) > 1 else {}
    with httpx.Client(base_url=base, timeout=300) as c, concurrent.futures.ThreadPoolExecutor(2) as pool:
        for i, text in enumerate(CHATS):
            # the encoder busy beside the engine: an embeddings request in flight during each answer
            bg = pool.submit(c.post, "/v1/embeddings", json=EMBED)
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 24, "logprobs": True,
                    "top_logprobs": 2, "temperature": 0} | extra
            if i % 2:   # seeded sampling, its own cache bypassed so the engine answers
                body |= {"temperature": 0.9, "seed": 1234 + i, "cache": False}
            _post(c, "/v1/chat/completions", body, models, salts, f"chat {i}", out)
            assert bg.result().status_code == 200
        _post(c, "/v1/completions", {"prompt": "The three primary colours are", "max_tokens": 16,
                                     "temperature": 0, "logprobs": 3, "cache": False}, models, salts, "completion", out)
    return out


def _starts(tmp_path, n: int, *args: str, models: tuple = (None,), salts: tuple = (None,), config=None,
            check=None) -> None:
    first = None
    for i in range(n):
        data_dir = tmp_path / f"start-{i}"
        data_dir.mkdir()
        extra = ("--models-config", str(config(data_dir))) if config else ()
        server = ModelServer(data_dir, "--semantic-cache", "on", *extra, *args)
        try:
            server.start()
            got = _sequence(server.base_url, models, salts)
            if check:
                check(server.base_url)
        finally:
            server.stop()
        first = first or {k: v[0] for k, v in got.items()}
        for k, answers in got.items():
            for j, b in enumerate(answers):
                assert first[k][0] == b[0], f"start {i}, {k} (copy {j}): {b[0]!r} != {first[k][0]!r}"
                assert first[k][1] == b[1], f"start {i}, {k} (copy {j}): same text, other logprobs"


@pytest.mark.parametrize("args,starts", [((), 2), (("--engine-process",), 2)], ids=["inproc", "engine-process"])
def test_same_answers_after_every_restart(tmp_path, args, starts):
    _starts(tmp_path, int(os.environ.get("KVSERVE_RESTARTS", starts)), *args)


def _two_models(data_dir):
    """The default GGUF twice: as packed Q4_1 and dequantized to fp32 (other kernels, other answers)."""
    from kvserve.model.registry import DEFAULT_MODEL as path

    config = data_dir / "models.json"
    config.write_text(json.dumps({"models": [{"name": "q4", "path": path, "kv_cache_memory": "64MiB"},
                                             {"name": "f32", "path": path, "weight_format": "fp32",
                                              "kv_cache_memory": "64MiB"}]}))
    return config


def test_same_answers_after_every_restart_with_two_models(tmp_path):
    _starts(tmp_path, int(os.environ.get("KVSERVE_RESTARTS", "2")), models=("q4", "f32"), config=_two_models)


def _both_replicas_served(base: str) -> None:
    text = httpx.get(base + "/metrics").text
    served = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("kvserve:replica_generation_tokens_total{")]
    assert len(served) == 2 and all(n > 0 for n in served), served


@pytest.mark.slow
def test_same_answers_after_every_restart_on_each_replica(tmp_path):
    pytest.importorskip("ray")
    _starts(tmp_path, int(os.environ.get("KVSERVE_RESTARTS", "3")), "--replicas", "2", "--kv-cache-memory", "64MiB",
            salts=SALTS, check=_both_replicas_served)


@pytest.mark.slow
@pytest.mark.parametrize("args", [(), ("--engine-process",)], ids=["inproc", "engine-process"])
def test_same_answers_after_fifty_restarts(tmp_path, args):
    _starts(tmp_path, 50, *args)
