"""A tiny random MoE (Qwen2-MoE: routed experts plus a shared one) served by the real server, with
the engine in the server's thread and in its own process: a chat request through the model's chat
template, its `kvserve_trace` with the per-expert token counts, and the per-layer, per-expert
counter in /metrics."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from families_gguf import write_gguf
from families_maker import make_hf_model


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe")
    make_hf_model("qwen2_moe").save_pretrained(root / "hf")
    return write_gguf(root / "hf", "qwen2_moe", root / "tiny-moe.gguf", qtype="Q8_0")


@pytest.mark.parametrize("engine", ["inproc", "process"])
def test_moe_chat_trace_and_metrics(model_server, moe_gguf, tmp_path, engine):
    srv = model_server(tmp_path, "--model", str(moe_gguf), engine=engine)
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-moe", "messages": [{"role": "user", "content": "the theme"}], "max_tokens": 6,
        "temperature": 0, "ignore_eos": True, "kvserve_trace": True})
    assert r.status_code == 200, r.text
    body = r.json()
    trace = body["kvserve_trace"]
    n_prompt, n_out = body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]
    assert n_out == 6
    experts = trace["moe_expert_tokens"]
    assert len(experts) == 8                                   # per expert, summed over the 3 layers
    assert sum(experts) == (n_prompt + n_out - 1) * 3 * 2      # every fed token, 3 layers, top-2
    metrics = httpx.get(srv.base_url + "/metrics", timeout=10).text
    rows = [(dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(v)) for labels, v in
            re.findall(r'^kvserve:moe_expert_tokens_total\{([^}]*)\} (\S+)$', metrics, re.MULTILINE)]
    assert {(int(lb["layer"]), int(lb["expert"])) for lb, _ in rows} == {(la, e) for la in range(3) for e in range(8)}
    assert sum(v for _, v in rows) == sum(experts)
