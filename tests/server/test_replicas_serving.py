"""`kvserve serve --replicas 2` as a real process: the gateway loads two engine replicas as Ray
actors (a local Ray cluster it starts and stops), reports the Ray engine client in /health, answers
chat completions streamed and not, and leaves no Ray process behind when it stops; and
`kvserve serve --tensor-parallel-size 2` answers and takes its other rank down when it stops."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("ray")


def _ray_processes() -> set[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if "raylet" in line or "gcs_server" in line}


def test_serve_with_two_replicas(tmp_path, model_server):
    before = _ray_processes()
    server = model_server(tmp_path, "--replicas", "2", "--kv-cache-memory", "64MiB", "--max-model-len", "512")
    health = httpx.get(server.base_url + "/health").json()
    assert health == {"status": "ok", "engine": "ray"}
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "temperature": 0}
    a = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert a.status_code == 200 and a.json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2
    metrics = httpx.get(server.base_url + "/metrics").text
    assert "kvserve" in metrics
    server.stop()
    assert server.proc.returncode == 0
    assert _ray_processes() <= before


def test_two_models_on_replicas_both_load(tmp_path, model_server):
    """Each `--model` gets its own replicas; both load and announce themselves (issue 51: the
    first model's stats once broke the load thread before the second model)."""
    server = model_server(tmp_path, "--replicas", "2", "--kv-cache-memory", "64MiB", "--max-model-len", "512",
                          "--model", "a=smollm2-135m-instruct", "--model", "b=smollm2-135m-instruct")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        ids = {m["id"] for m in httpx.get(server.base_url + "/v1/models").json()["data"]}
        if {"a", "b"} <= ids:
            break
        time.sleep(1)
    assert {"a", "b"} <= ids
    for name in ("a", "b"):
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
            "model": name, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4})
        assert r.status_code == 200, r.text
    log = server.log_path.read_text()
    assert "model a loaded" in log and "model b loaded" in log and "KeyError" not in log
    server.stop()
    assert server.proc.returncode == 0


def test_serve_with_tensor_parallel_size_2(tmp_path, model_server):
    server = model_server(tmp_path, "--tensor-parallel-size", "2", "--kv-cache-memory", "64MiB",
                          "--max-model-len", "512")
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert "kvserve:engine_steps_total" in httpx.get(server.base_url + "/metrics").text
    server.stop()
    assert server.proc.returncode == 0
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert f"\"parent_pid\": {server.proc.pid}" not in ps        # the other rank ended with the server
