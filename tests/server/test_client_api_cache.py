"""The semantic cache's per-key isolation (issue 49) on the generating routes of the client APIs:
Anthropic's /v1/messages and Ollama's /api/chat and /api/generate become chat requests on the one
generation path, so a repeated question is answered from the cache for its own key (and end user)
only. A tiny random model in this process keeps it fast; the official clients send the requests."""

from __future__ import annotations

import anthropic
import httpx
import ollama
import pytest
from client_api_server import NO_CLIENT_WARNINGS, loaded, no_client_warnings, tiny_model  # noqa: F401 (autouse)
from servers import InProcessServer

from kvserve.server.settings import ServerSettings
from kvserve.server.stores.keys import KeyStore

pytestmark = NO_CLIENT_WARNINGS
CACHE = "x-kvserve-cache"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("apicache")
    tiny = tiny_model(root / "tiny.gguf")
    store = KeyStore(root / "kvserve.db")
    keys = {"a": store.create("tenant-a"), "b": store.create("tenant-b")}
    store.close()
    with InProcessServer(ServerSettings(model=str(tiny), served_model_name="tiny", data_dir=root)) as s:
        s.keys = keys
        yield loaded(s)


def test_messages_hit_for_their_key_and_user_only(srv):
    ask = [{"role": "user", "content": "What is the capital of Italy?"}]

    def cache(key: str, **kw) -> str | None:
        c = anthropic.Anthropic(base_url=srv.base_url, api_key=srv.keys[key], max_retries=0)
        r = c.messages.with_raw_response.create(model="tiny", max_tokens=6, messages=ask,
                                                extra_body={"temperature": 0}, **kw)
        assert r.parse().content
        return r.headers.get(CACHE)

    assert cache("a") is None
    assert cache("a") == "semantic"
    assert cache("b") is None                                            # another key
    assert cache("a", metadata={"user_id": "someone-else"}) is None      # another end user of the key


@pytest.mark.parametrize(("path", "ask"), (("/api/chat", {"messages": [{"role": "user", "content": "What is the capital of Spain?"}]}),
                                           ("/api/generate", {"prompt": "What is the capital of Portugal?"})))
def test_ollama_hits_for_their_key_only(srv, path, ask):
    """A repeated question hits for its key only (the header read over plain HTTP: the ollama client
    returns no headers); a hit is an answer the client parses."""
    seen = []
    for key in ("a", "a", "b"):
        r = httpx.post(srv.base_url + path, headers={"Authorization": f"Bearer {srv.keys[key]}"}, timeout=60,
                       json={"model": "tiny", "stream": False, "options": {"temperature": 0, "num_predict": 6}, **ask})
        assert r.status_code == 200, r.text
        seen.append(r.headers.get(CACHE))
    assert seen == [None, "semantic", None]
    c = ollama.Client(host=srv.base_url, headers={"Authorization": f"Bearer {srv.keys['b']}"})
    body = {"model": "tiny", "options": {"temperature": 0, "num_predict": 6}, **ask}
    again = c.chat(**body) if path == "/api/chat" else c.generate(**body)     # b's own entry now: the client parses it
    assert again.done
