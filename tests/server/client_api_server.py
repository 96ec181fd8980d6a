"""The model server the client-API tests (test_anthropic_api.py, test_ollama_api.py) share the
shape of: the real model, keys `a`, `usage`, `out` (output moderation blocking WORD, checked every
4 tokens) and one key limited to 1 request/minute per route."""

from __future__ import annotations

import logging

import pydantic
import pytest
from servers import loaded, tiny_model  # noqa: F401 (re-exported for the client-API tests)
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


CLIENT_LOGGERS = ("anthropic", "openai", "ollama", "cohere", "httpx")
# Each official client's test module: a Python warning in a test is an error (the marker), and so is a
# warning an official client logs (the fixture): the wire bytes are what the client parses, without complaint.
# (A client the test drops without closing leaves a ResourceWarning for its socket: that one is the test's.)
NO_CLIENT_WARNINGS = pytest.mark.filterwarnings("error", "ignore::ResourceWarning")


def unknown_fields(obj, path: str = "$") -> list[str]:
    """Every field of a parsed SDK object (anthropic, openai: pydantic models that keep extras) that
    its type does not declare: what a client would drop."""
    out = []
    if isinstance(obj, pydantic.BaseModel):
        out += [f"{path}.{k}" for k in (obj.model_extra or {})]
        for name in type(obj).model_fields:
            out += unknown_fields(getattr(obj, name), f"{path}.{name}")
    elif isinstance(obj, list):
        for i, x in enumerate(obj):
            out += unknown_fields(x, f"{path}[{i}]")
    return out


@pytest.fixture(autouse=True)
def no_client_warnings(caplog):
    caplog.set_level(logging.WARNING)
    yield
    logged = [f"{r.name}: {r.getMessage()}" for r in caplog.records
              if r.levelno >= logging.WARNING and r.name.split(".")[0] in CLIENT_LOGGERS]
    assert not logged, logged


