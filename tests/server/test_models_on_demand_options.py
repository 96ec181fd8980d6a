"""The options of models on demand, without a server: keep_alive durations, the memory budget, the
directory scan and `kvserve serve`'s model options (server/routing/residency.py, pool.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvserve.errors import InvalidRequest, ModelNotFound
from kvserve.server.routing.pool import ModelPool, model_options
from kvserve.server.routing.residency import memory_budget, model_bytes, parse_keep_alive, scan_models_dir
from kvserve.server.settings import ServerSettings


def test_keep_alive_as_ollama_reads_it():
    assert [parse_keep_alive(v) for v in ("5m", "1h30m", "300ms", "90", "2.5", 0, "0", 7, 12.5)] == \
        [300.0, 5400.0, 0.3, 90.0, 2.5, 0.0, 0.0, 7.0, 12.5]
    assert parse_keep_alive(-1) == parse_keep_alive("-5m") == -1.0      # negative: forever
    assert parse_keep_alive(None) is None and parse_keep_alive("") is None
    for bad in ("soon", "5 minutes", "5m3", True, [1]):
        with pytest.raises(InvalidRequest):
            parse_keep_alive(bad)


def test_memory_budget():
    assert memory_budget("2GiB") == 2 << 30
    assert memory_budget(123456789) == memory_budget("123456789") == 123456789
    assert 0 < memory_budget(0.5) and 0 < memory_budget(None)
    for bad in ("lots", -3, 0):
        with pytest.raises(InvalidRequest):
            memory_budget(bad)


def test_scan_and_pool_entries(tmp_path):
    from kvserve.model.registry import resolve

    src = resolve(None).path
    (tmp_path / "b.gguf").symlink_to(src)
    (tmp_path / "a.gguf").symlink_to(src)
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty").mkdir()
    assert [n for n, _ in scan_models_dir(tmp_path)] == ["a", "b"]
    with pytest.raises(InvalidRequest):
        scan_models_dir(tmp_path / "missing")
    size = model_bytes(str(tmp_path / "a.gguf"), {"kv_cache_memory": "64MiB"})
    assert size == src.stat().st_size + (64 << 20)

    pool = ModelPool(ServerSettings(load_model=False, models_dir=str(tmp_path)))
    assert pool.names() == ["a", "b"] and pool.pinned() == [] and pool.default.name == "a"
    assert [s.state for s in pool.statuses()] == ["unloaded", "unloaded"] and pool.statuses(loaded_only=True) == []
    assert pool.cards(0) == [] and [c["kvserve_state"] for c in pool.cards(0, unloaded=True)] == ["unloaded"] * 2
    (tmp_path / "c.gguf").symlink_to(src)             # copied in later: found by the first request naming it
    with pytest.raises(ModelNotFound):
        pool.entry("c")                               # a lookup never scans (it runs on the event loop)
    pool._scanned_at = 0.0
    asyncio.run(pool.rescan_for("c"))                 # a generation's hold does, in a thread
    assert pool.entry("c").name == "c"
    (tmp_path / "d.gguf").symlink_to(src)
    asyncio.run(pool.rescan_for("d"))                 # at most once every SCAN_EVERY_S
    with pytest.raises(ModelNotFound):
        pool.entry("d")
    (tmp_path / "d.gguf").unlink()

    pinned = ModelPool(ServerSettings(load_model=False, model="smollm2-135m-instruct", models_dir=str(tmp_path)))
    assert [e.spec.on_demand for e in pinned.entries] == [False, True, True, True]

    with pytest.raises(InvalidRequest, match="holds no model"):
        ModelPool(ServerSettings(load_model=False, models_dir=str(tmp_path / "empty")))


def test_model_options(tmp_path):
    specs, _, _, on_demand = model_options([], None, str(tmp_path), "1GiB", "10m")
    assert specs == [] and on_demand == {"models_dir": str(tmp_path), "models_memory": "1GiB", "keep_alive_s": 600.0}
    config = tmp_path / "m.json"
    config.write_text(json.dumps({"models_dir": str(tmp_path), "keep_alive": -1, "model_load_timeout": 5,
                                  "models": [{"name": "x", "path": "p", "on_demand": True}]}))
    specs, _, _, on_demand = model_options([], config, None, None, "1h")
    assert specs[0].on_demand and on_demand["keep_alive_s"] == 3600.0 and on_demand["model_load_timeout_s"] == 5.0
    specs, _, _, on_demand = model_options([], None)
    assert specs[0].path is None and on_demand["models_dir"] is None      # nothing given: the default model
    for args in (([], None, str(tmp_path / "missing")), ([], None, None, "lots"), ([], None, None, None, "soon")):
        with pytest.raises(InvalidRequest):
            model_options(*args)
