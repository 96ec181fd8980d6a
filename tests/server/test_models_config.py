"""Model specs from `--model` and `--models-config` (JSON, TOML), and the pool's name lookup."""

from __future__ import annotations

import pytest

from kvserve.errors import InvalidRequest, ModelNotFound, Overloaded
from kvserve.server.routing.pool import ModelPool, ModelSpec, read_config
from kvserve.server.settings import ServerSettings


def test_parse_model_option():
    assert ModelSpec.parse("small=./a.gguf") == ModelSpec(name="small", path="./a.gguf")
    assert ModelSpec.parse("./a.gguf") == ModelSpec(name=None, path="./a.gguf")
    for bad in ("=x", "small=", " = "):
        with pytest.raises(InvalidRequest, match="NAME=PATH"):
            ModelSpec.parse(bad)


def test_config_json_and_toml(tmp_path):
    j = tmp_path / "m.json"
    j.write_text('{"models": [{"name": "a", "path": "p", "kv_cache_memory": "64MiB", "cost_per_1k_tokens": 0.5,'
                 ' "engine": {"max_model_len": 512}}], "router": {"name": "auto"}}')
    data = read_config(j)
    spec = ModelSpec.from_dict(data["models"][0])
    assert spec.engine == {"max_model_len": 512, "kv_cache_memory": "64MiB"} and spec.cost_per_1k_tokens == 0.5
    t = tmp_path / "m.toml"
    t.write_text('[[models]]\nname = "a"\npath = "p"\n\n[[models]]\nname = "b"\npath = "q"\nengine_process = true\n')
    specs = [ModelSpec.from_dict(d) for d in read_config(t)["models"]]
    assert [s.name for s in specs] == ["a", "b"] and specs[1].engine_process is True
    for text, msg in (("{", "not valid JSON"), ('{"models": 3}', "expected"), ("[]", "expected")):
        j.write_text(text)
        with pytest.raises(InvalidRequest, match=msg):
            read_config(j)
    with pytest.raises(InvalidRequest, match="No such file"):
        read_config(tmp_path / "missing.json")
    with pytest.raises(InvalidRequest, match="needs at least"):
        ModelSpec.from_dict({"kv_cache_memory": "1GiB"})
    # a model's scheduler settings, as `kvserve serve` takes them
    assert ModelSpec.from_dict({"path": "p", "max_step_ms": 50, "max_decode_slowdown": 0}).engine == {
        "max_step_ms": 50, "max_decode_slowdown": 0}


def test_pool_names_and_errors(tmp_path):
    s = ServerSettings(load_model=False, data_dir=tmp_path)
    with pytest.raises(InvalidRequest, match="share a name"):
        ModelPool(s, [ModelSpec("a", "x"), ModelSpec("a", "y")])
    pool = ModelPool(s, [ModelSpec("a", "x"), ModelSpec("b", "y")])
    assert pool.entry(None) is pool.entry("") is pool.entry("a") and pool.entry("b").spec.path == "y"
    with pytest.raises(ModelNotFound, match="'a', 'b'") as e:
        pool.entry("c")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    with pytest.raises(Overloaded, match="still loading"):    # known but not loaded yet: 503
        pool.resolve("b")
    pool.entry("b").load_error = "bad magic"
    with pytest.raises(Overloaded, match="bad magic"):
        pool.resolve("b")
