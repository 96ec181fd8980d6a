"""Ollama's `suffix` (fill in the middle) end to end with the `ollama` client, on a tiny random
model whose vocabulary has FIM tokens (the default model has none: test_ollama_api.py checks its
400): the prompt framed as prefix-suffix-middle token ids, counted and capped like any prompt,
logprobs on it, and "insert" among the model's capabilities."""

from __future__ import annotations

import ollama
import pytest
from client_api_server import NO_CLIENT_WARNINGS, loaded, no_client_warnings, tiny_model  # noqa: F401 (autouse)
from servers import InProcessServer

from kvserve.server.api.ollama_fim import fim_prompt
from kvserve.server.settings import ServerSettings

pytestmark = NO_CLIENT_WARNINGS
FIM = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n    return total\n"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("fim")
    tiny = tiny_model(root / "tiny.gguf", extra_specials=FIM)
    settings = ServerSettings(model=str(tiny), served_model_name="coder", data_dir=root, semantic_cache=False)
    with InProcessServer(settings) as s:
        yield loaded(s)


def test_suffix_fills_in_the_middle(srv):
    c = ollama.Client(host=srv.base_url)
    tokenizer = srv.state.pool.default.engine.tokenizer
    ids = fim_prompt(tokenizer, "coder", PREFIX, SUFFIX)
    assert ids[0] == tokenizer.hf.token_to_id("<fim_prefix>") and ids[-1] == tokenizer.hf.token_to_id("<fim_middle>")
    r = c.generate(model="coder", prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": 6})
    assert r.done and r.prompt_eval_count == len(ids) and 0 < r.eval_count <= 6
    parts = list(c.generate(model="coder", prompt=PREFIX, suffix=SUFFIX, stream=True,
                            options={"temperature": 0, "num_predict": 6}))
    assert "".join(p.response for p in parts) == r.response and parts[-1].done    # greedy: the same
    lp = c.generate(model="coder", prompt=PREFIX, suffix=SUFFIX, logprobs=True, top_logprobs=2,
                    options={"temperature": 0, "num_predict": 4})
    assert len(lp.logprobs) == lp.eval_count and len(lp.logprobs[0].top_logprobs) == 2
    capped = c.generate(model="coder", prompt=PREFIX, suffix=SUFFIX, options={"num_ctx": len(ids) + 2,
                                                                               "num_predict": 50})
    assert capped.eval_count <= 2 and capped.done_reason == "length"
    assert c.generate(model="coder", suffix=SUFFIX, options={"num_predict": 2}).prompt_eval_count == \
        len(fim_prompt(tokenizer, "coder", "", SUFFIX))        # an empty prompt with a suffix still fills in
    assert "insert" in c.show("coder").capabilities
