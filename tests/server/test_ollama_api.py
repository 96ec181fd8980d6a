"""Ollama's API with the official `ollama` client (`ollama.Client(host=...)`, as a front-end uses
it) against the real model: chat and generate (streamed NDJSON and `stream: false`), options as
sampling, num_ctx as a cap, format json and a JSON schema, tools, think, embed, tags/show/ps and
version; every object checked against the client's own types (no field it would drop). The
gateway's gates apply as on OpenAI's routes: the key, the request bucket, input moderation, the
usage ledger; errors are `{"error": "..."}`."""

from __future__ import annotations

import json
import typing

import client_api_server
import httpx
import ollama
import pydantic
import pytest
from client_api_server import ECHO, NO_CLIENT_WARNINGS, no_client_warnings  # noqa: F401 (an autouse fixture)
from ollama._types import (
    ChatResponse,
    EmbedResponse,
    GenerateResponse,
    ListResponse,
    ProcessResponse,
    ShowResponse,
)

from kvserve.server.stores.keys import KeyStore

pytestmark = NO_CLIENT_WARNINGS
MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ROUTES = (("post", "/api/chat"), ("post", "/api/generate"), ("post", "/api/embed"), ("post", "/api/show"),
          ("get", "/api/tags"), ("get", "/api/ps"), ("get", "/api/version"))
# Fields real Ollama servers send that this client version does not model.
KNOWN_EXTRAS = {"name"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_server):
    return client_api_server.start(tmp_path_factory, model_server, "ollama", [path for _, path in ROUTES])


def client(server, key: str = "a") -> ollama.Client:
    return ollama.Client(host=server.base_url, headers={"Authorization": f"Bearer {server.keys[key]}"}, timeout=300)


def _models(annotation) -> list[type[pydantic.BaseModel]]:
    """The pydantic models inside a field's annotation (Optional[X], Sequence[X], Union[...])."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def unknown_fields(model: type[pydantic.BaseModel], data, path: str = "$") -> list[str]:
    """Keys of `data` that `model` (the client's type) does not declare: what the client drops."""
    if isinstance(data, list):
        return [x for i, item in enumerate(data) for x in unknown_fields(model, item, f"{path}[{i}]")]
    if not isinstance(data, dict):
        return []
    fields = {(f.alias or name): f for name, f in model.model_fields.items()}
    out = [f"{path}.{k}" for k in data if k not in fields and k not in KNOWN_EXTRAS]
    for key, value in data.items():
        if key in fields:
            for sub in _models(fields[key].annotation):
                out += unknown_fields(sub, value, f"{path}.{key}")
    return out


def raw(server, path: str, body: dict | None = None, key: str = "a") -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.keys[key]}"}
    if body is None:
        return httpx.get(server.base_url + path, headers=headers, timeout=300)
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=300)


def lines(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(x) for x in r.text.splitlines()]


def test_chat_whole_and_streamed(server):
    c = client(server)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count from one to five."}]
    whole = c.chat(model=MODEL, messages=msgs, options={"temperature": 0, "num_predict": 12})
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.message.content and whole.eval_count > 0 and whole.prompt_eval_count > 0
    parts = list(c.chat(model=MODEL, messages=msgs, stream=True, options={"temperature": 0, "num_predict": 12}))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content   # greedy: the same answer
    body = {"model": MODEL, "messages": msgs, "options": {"temperature": 0, "num_predict": 12}}
    for line in lines(raw(server, "/api/chat", body)):
        assert unknown_fields(ChatResponse, line) == [], line
    one = raw(server, "/api/chat", {**body, "stream": False})
    assert unknown_fields(ChatResponse, one.json()) == [] and one.json()["message"]["content"] == whole.message.content


def test_generate_whole_streamed_raw_and_load(server):
    c = client(server)
    g = c.generate(model=MODEL, prompt="Say hi.", system="Be brief.", options={"temperature": 0, "num_predict": 8})
    assert g.done and g.response and g.eval_count > 0
    parts = list(c.generate(model=MODEL, prompt="Say hi.", system="Be brief.", stream=True,
                            options={"temperature": 0, "num_predict": 8}))
    assert "".join(p.response for p in parts) == g.response and parts[-1].done
    for line in lines(raw(server, "/api/generate", {"model": MODEL, "prompt": "Hi", "options": {"num_predict": 4}})):
        assert unknown_fields(GenerateResponse, line) == [], line
    r = c.generate(model=MODEL, prompt="The capital of France is", raw=True, options={"temperature": 0, "num_predict": 4})
    assert r.response and r.prompt_eval_count < g.prompt_eval_count     # no template around a raw prompt
    loaded = c.generate(model=MODEL + ":latest")       # an empty prompt loads the model
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    assert client(server).chat(model=MODEL, messages=[], keep_alive=0).done_reason == "unload"


def test_options_map_to_sampling(server):
    c = client(server)
    opts = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": 7, "repeat_penalty": 1.1,
            "stop": ["\n\n"], "num_predict": 10, "num_thread": 4, "mirostat": 0}
    a = c.generate(model=MODEL, prompt="Tell me a story.", options=opts)
    b = c.generate(model=MODEL, prompt="Tell me a story.", options=opts)
    assert a.response == b.response and a.eval_count <= 10          # seeded: the same answer
    capped = c.generate(model=MODEL, prompt="Tell me a story.", options={"num_ctx": a.prompt_eval_count + 3,
                                                                          "num_predict": 50, "temperature": 0})
    assert capped.eval_count <= 3 and capped.done_reason == "length"
    with pytest.raises(ollama.ResponseError) as e:
        c.generate(model=MODEL, prompt="Tell me a story.", options={"num_ctx": 4})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.generate(model=MODEL, prompt="Hi", options={"no_such_option": 1})
    assert e.value.status_code == 400


def test_format_json_and_schema(server):
    c = client(server)
    r = c.chat(model=MODEL, messages=[{"role": "user", "content": "Describe a cat as JSON."}], format="json",
               options={"num_predict": 40, "temperature": 0})
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict)
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = c.generate(model=MODEL, prompt="Is 7 prime?", format=schema, options={"num_predict": 32})
    assert json.loads(r.response)["answer"] in ("yes", "no")


def test_tools_and_tool_turns(server):
    c = client(server)
    ask = [{"role": "user", "content": "What's the weather in Paris? Use the tool."}]
    r = c.chat(model=MODEL, messages=ask, tools=[WEATHER], options={"temperature": 0, "num_predict": 48})
    assert r.done
    if r.message.tool_calls:       # the model chose to call
        call = r.message.tool_calls[0]
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
        streamed = [p for p in c.chat(model=MODEL, messages=ask, tools=[WEATHER], stream=True,
                                      options={"temperature": 0, "num_predict": 48}) if p.message.tool_calls]
        assert streamed and streamed[0].message.tool_calls[0].function.arguments == call.function.arguments
    follow = c.chat(model=MODEL, tools=[WEATHER], options={"num_predict": 8}, messages=ask + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Sunny, 24C", "tool_name": "get_weather"}])
    assert follow.done and follow.prompt_eval_count > 0


def test_think(server):
    c = client(server)
    r = c.chat(model=MODEL, messages=[{"role": "user", "content": "Is 7 prime?"}], think=True,
               options={"num_predict": 24})
    assert r.message.thinking
    parts = list(c.generate(model=MODEL, prompt="Is 7 prime?", think="low", stream=True, options={"num_predict": 16}))
    assert any(p.thinking for p in parts)


def test_embed_tags_show_ps_version(server):
    c = client(server)
    e = c.embed(model="all-minilm-l6-v2", input=["a cat", "a dog"])
    assert len(e.embeddings) == 2 and len(e.embeddings[0]) == 384
    assert unknown_fields(EmbedResponse, raw(server, "/api/embed", {"model": "all-minilm-l6-v2", "input": "x"}).json()) == []
    openai_ids = [m["id"] for m in raw(server, "/v1/models").json()["data"]]
    tags = raw(server, "/api/tags").json()
    assert unknown_fields(ListResponse, tags) == []
    assert [m.model for m in c.list().models] == openai_ids        # the same models as /v1/models
    shown = c.show(MODEL)
    assert "completion" in shown.capabilities and shown.modelinfo["context_length"] == 1024 and shown.template
    assert unknown_fields(ShowResponse, raw(server, "/api/show", {"model": MODEL}).json()) == []
    assert "embedding" in c.show("all-minilm-l6-v2").capabilities
    ps = c.ps()
    assert [m.model for m in ps.models] == [MODEL] and ps.models[0].context_length == 1024
    assert unknown_fields(ProcessResponse, raw(server, "/api/ps").json()) == []
    assert raw(server, "/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as err:
        c.show("no-such-model")
    assert err.value.status_code == 404 and "not found" in err.value.error


def test_errors_in_ollama_shape(server):
    c = client(server)
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="nope", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 404
    r = raw(server, "/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "bogus": 1})
    assert r.status_code == 400 and set(r.json()) == {"error"} and "bogus" in r.json()["error"]
    r = raw(server, "/api/nothing-here", {})
    assert r.status_code == 404 and set(r.json()) == {"error"}


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_gates_per_route(server, method, path):
    url = server.base_url + path
    r = httpx.request(method, url, json={} if method == "post" else None, timeout=60)
    assert r.status_code == 401 and set(r.json()) == {"error"}
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server.base_url).list()
    assert e.value.status_code == 401
    headers = {"Authorization": f"Bearer {server.keys[path]}"}
    assert httpx.request(method, url, json={} if method == "post" else None, headers=headers, timeout=60).status_code != 429
    r = httpx.request(method, url, json={} if method == "post" else None, headers=headers, timeout=60)
    assert r.status_code == 429 and set(r.json()) == {"error"} and r.headers["retry-after"]


def test_moderation_and_usage(server):
    c = client(server, "usage")
    flagged = [{"role": "user", "content": "I will stab him tonight"}]
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as e:
            out = c.chat(model=MODEL, messages=flagged, stream=stream)
            if stream:
                list(out)
        assert e.value.status_code == 400 and "moderation" in e.value.error
    with pytest.raises(ollama.ResponseError):
        c.generate(model=MODEL, prompt="I will stab him tonight")
    a = c.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 5})
    b = list(c.generate(model=MODEL, prompt="Hello", stream=True, options={"num_predict": 5}))[-1]
    [row] = KeyStore(server.data_dir / "kvserve.db").usage("usage")
    assert row["requests"] == 2
    assert row["prompt_tokens"] == a.prompt_eval_count + b.prompt_eval_count
    assert row["completion_tokens"] == a.eval_count + b.eval_count
    e = c.embed(model="all-minilm-l6-v2", input=["a cat", "a dog"])         # the encoder's tokens, charged too
    [row] = KeyStore(server.data_dir / "kvserve.db").usage("usage")
    assert row["prompt_tokens"] == a.prompt_eval_count + b.prompt_eval_count + e.prompt_eval_count


def test_stream_error_line_is_raised():
    """An error after the stream started is one `{"error": ...}` line, which the client raises."""
    from kvserve.server.api.ollama_wire import OllamaRenderer

    [line] = OllamaRenderer.failed(500, "boom")
    assert json.loads(line) == {"error": "boom"} and line.endswith("\n")


def test_output_moderation_cut(server):
    c = client(server, "out")
    r = c.chat(model=MODEL, messages=ECHO, options={"temperature": 0, "num_predict": 48})
    assert r.done_reason == "content_filter"
    parts = list(c.chat(model=MODEL, messages=ECHO, stream=True, options={"temperature": 0, "num_predict": 48}))
    assert parts[-1].done_reason == "content_filter"
    assert "zanzibar zanzibar zanzibar zanzibar" not in "".join(p.message.content for p in parts)


def test_logprobs_whole_streamed_and_raw(server):
    c = client(server)
    ask = [{"role": "user", "content": "Count from one to five."}]
    opts = {"temperature": 0, "num_predict": 8}
    whole = c.chat(model=MODEL, messages=ask, options=opts, logprobs=True, top_logprobs=3)
    assert len(whole.logprobs) == whole.eval_count
    assert whole.message.content in "".join(lp.token for lp in whole.logprobs)     # each token's own text
    for lp in whole.logprobs:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[-1].logprob
        assert lp.token in [t.token for t in lp.top_logprobs]        # greedy: the chosen token is among the best
    parts = list(c.chat(model=MODEL, messages=ask, options=opts, logprobs=True, top_logprobs=3, stream=True))
    streamed = [lp for p in parts for lp in (p.logprobs or [])]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in whole.logprobs]
    body = {"model": MODEL, "messages": ask, "options": opts, "logprobs": True, "top_logprobs": 2}
    for line in lines(raw(server, "/api/chat", body)):
        assert unknown_fields(ChatResponse, line) == [], line
    assert unknown_fields(ChatResponse, raw(server, "/api/chat", {**body, "stream": False}).json()) == []
    plain = c.generate(model=MODEL, prompt="Say hi.", options=opts, logprobs=True)
    assert len(plain.logprobs) == plain.eval_count and all(lp.top_logprobs is None for lp in plain.logprobs)
    assert "top_logprobs" not in raw(server, "/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False,
                                                               "options": opts, "logprobs": True}).json()["logprobs"][0]
    text = c.generate(model=MODEL, prompt="The capital of France is", raw=True, options=opts, logprobs=True,
                      top_logprobs=1)
    assert len(text.logprobs) == text.eval_count and len(text.logprobs[0].top_logprobs) == 1
    assert c.generate(model=MODEL, prompt="Hi", options=opts).logprobs is None      # only when asked for
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model=MODEL, messages=ask, logprobs=True, top_logprobs=99)
    assert e.value.status_code == 400 and "top_logprobs" in e.value.error


def test_images_are_a_clear_400(server):
    c = client(server)
    png = bytes.fromhex("89504e470d0a1a0a")
    for call in (lambda: c.chat(model=MODEL, messages=[{"role": "user", "content": "What is this?", "images": [png]}]),
                 lambda: c.generate(model=MODEL, prompt="What is this?", images=[png])):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 400 and "does not support images" in e.value.error and MODEL in e.value.error
    r = raw(server, "/api/generate", {"model": MODEL, "prompt": "What is this?", "images": ["iVBORw0KGgo="]})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    assert c.chat(model=MODEL, messages=[{"role": "user", "content": "Hi", "images": []}],
                  options={"num_predict": 2}).done       # an empty list is no image


def test_suffix_without_fim_tokens_is_a_clear_400(server):
    c = client(server)
    with pytest.raises(ollama.ResponseError) as e:
        c.generate(model=MODEL, prompt="def add(a, b):\n    ", suffix="\n    return c\n")
    assert e.value.status_code == 400 and "does not support insert" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.generate(model=MODEL, prompt="def add(a, b):", suffix="return c", raw=True)
    assert e.value.status_code == 400 and "raw and suffix" in e.value.error
    assert "insert" not in c.show(MODEL).capabilities


def test_tags_show_ps_describe_the_files(server):
    import hashlib

    from kvserve.model.bert import minilm_zip
    from kvserve.model.registry import resolve

    gguf, encoder = resolve(None).path, minilm_zip()
    c = client(server)
    models = {m.model: m for m in c.list().models}
    llm, emb = models[MODEL], models["all-minilm-l6-v2"]
    assert llm.size == gguf.stat().st_size and llm.digest == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert (llm.details.format, llm.details.family, llm.details.families) == ("gguf", "llama", ["llama"])
    assert (llm.details.parameter_size, llm.details.quantization_level) == ("134.52M", "Q4_1")
    assert llm.modified_at.timestamp() == pytest.approx(gguf.stat().st_mtime, abs=1)
    assert emb.size == encoder.stat().st_size and emb.digest == hashlib.sha256(encoder.read_bytes()).hexdigest()
    assert (emb.details.format, emb.details.family, emb.details.parameter_size) == ("safetensors", "bert", "22.71M")
    shown = c.show(MODEL)
    assert shown.details == llm.details and shown.modelinfo["llama.context_length"] == 8192
    assert shown.modelinfo["general.parameter_count"] == 134515008 and shown.modelinfo["general.architecture"] == "llama"
    assert not any(k.startswith("tokenizer.") for k in shown.modelinfo)      # no vocabulary in a plain show
    assert c.show("all-minilm-l6-v2").modelinfo["bert.hidden_size"] == 384
    [running] = c.ps().models
    assert running.digest == llm.digest and running.details == llm.details
    assert running.size > llm.size and running.size_vram == 0        # the weights and the KV cache


def fim_tokenizer(fim: bool = True):
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from kvserve.tokenizer.tokenizer import Tokenizer

    hf = HFTokenizer(models.WordLevel({"[UNK]": 0, "def": 1, "f": 2, "return": 3, "x": 4}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    if fim:
        hf.add_special_tokens([AddedToken(t, special=True) for t in ("<|fim_prefix|>", "<|fim_suffix|>",
                                                                     "<|fim_middle|>")])
    return Tokenizer(hf, bos_token_id=None, eos_token_ids=[])


def test_fim_prompt_frames_prefix_and_suffix():
    from kvserve.errors import InvalidRequest
    from kvserve.server.api.ollama import GenerateBody, generate_request
    from kvserve.server.api.ollama_fim import fim_prompt, fim_tokens

    tok = fim_tokenizer()
    pre, suf, mid = fim_tokens(tok)
    assert fim_prompt(tok, "m", "def f", "return x") == [pre, 1, 2, suf, 3, 4, mid]
    body = GenerateBody(model="m", prompt="def f", suffix="return x", system="ignored", think=True,
                        options={"num_predict": 5}, logprobs=True)
    out, num_ctx, is_chat = generate_request(body, fim_prompt(tok, "m", body.prompt, body.suffix))
    assert not is_chat and num_ctx is None and out["prompt"][0][0] == pre and out["max_tokens"] == 5
    assert "reasoning_effort" not in out and out["logprobs"] == 0 and "messages" not in out
    plain = fim_tokenizer(fim=False)
    assert fim_tokens(plain) is None
    with pytest.raises(InvalidRequest) as e:
        fim_prompt(plain, "m", "a", "b")
    assert e.value.status == 400 and e.value.param == "suffix"

