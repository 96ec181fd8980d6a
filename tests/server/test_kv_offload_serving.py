"""The KV disk tier through `kvserve serve --kv-offload-dir`: a long system prompt evicted from a
small KV pool is served from disk, and after a restart on the same directory, with the same greedy
answer (the usage's cached tokens show the hit)."""

from __future__ import annotations

import httpx

from kvserve.train.data import load_corpus

POOL = str(48 * 368_640)          # 48 blocks of the default model's fp16 KV (768 tokens)


def _chat(base: str, system: str, question: str) -> tuple[str, int]:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    j = r.json()
    return j["choices"][0]["message"]["content"], j["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_system_prompt_comes_back_from_disk_and_after_a_restart(tmp_path, model_server):
    text = load_corpus(max_chars=12_000)
    system, filler = text[:1500], text[4000:6400]          # ~350 and ~600 tokens
    args = ("--kv-offload-dir", str(tmp_path / "kv"), "--kv-cache-memory", POOL, "--max-model-len", "768")
    srv = model_server(tmp_path, *args)
    _chat(srv.base_url, system, "Who is speaking?")
    _chat(srv.base_url, filler, "Summarize.")             # evicts the system prompt's blocks
    answer, cached = _chat(srv.base_url, system, "What happens next?")
    assert cached >= 320
    srv.stop()

    again = model_server(tmp_path, *args)
    answer2, cached2 = _chat(again.base_url, system, "What happens next?")
    assert cached2 >= 320
    assert answer2 == answer
    assert "KV disk tier:" in again.log_path.read_text()
    metrics = httpx.get(again.base_url + "/metrics", timeout=30).text
    hits = [ln for ln in metrics.splitlines() if ln.startswith("kvserve:kv_offload_hit_blocks")]
    assert hits and float(hits[0].split()[-1]) >= 20
