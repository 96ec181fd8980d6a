"""The model server the client-API tests (test_anthropic_api.py, test_ollama_api.py) share the
shape of: the real model, keys `a`, `usage`, `out` (output moderation blocking WORD, checked every
4 tokens) and one key limited to 1 request/minute per route."""

from __future__ import annotations

from typer.testing import CliRunner

from kvserve.server.cli import keys_app
from kvserve.server.stores.keys import KeyStore

WORD = "zanzibar"
ASK = {"role": "user", "content": f"Say {WORD} eight times."}
ECHO = [ASK, {"role": "assistant", "content": " ".join([WORD] * 8)}, ASK]   # the model copies its last answer


def start(tmp_path_factory, model_server, name: str, routes: list[str]):
    data_dir = tmp_path_factory.mktemp(name)
    store = KeyStore(data_dir / "kvserve.db")
    keys = {"a": store.create("a"), "usage": store.create("usage"), "out": store.create("out")}
    keys |= {route: store.create(f"limited{i}", rpm=1) for i, route in enumerate(routes)}
    store.close()
    r = CliRunner().invoke(keys_app, ["moderation", "out", "--mode", "output", "--check-every", "4", "--block",
                                      f"places={WORD}", "--data-dir", str(data_dir)])
    assert r.exit_code == 0, r.output
    srv = model_server(data_dir, "--max-model-len", "1024")
    srv.keys = keys
    return srv
