"""The KV disk tier (engine/kv_offload.py) on the real model: a shared prefix evicted from a small
KV pool is read back from disk, and after a restart on the same directory, with the greedy answer
of a cold run token for token (fp16 and int8 KV); bad files are misses; salts stay apart."""

from __future__ import annotations

import errno
import logging

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.disagg import prompt_block_hashes
from kvserve.engine.kv_offload import DiskKVStore
from kvserve.engine.messages import EngineCoreRequest
from kvserve.engine.model_runner import ModelRunner
from kvserve.train.data import load_corpus

SHARED = 320
POOL_BLOCKS = 48
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ids(loaded) -> list[int]:
    return loaded.tokenizer.encode(load_corpus(max_chars=40_000))


@pytest.fixture(scope="module")
def prompts(ids):
    shared = ids[:SHARED]
    return shared + ids[5000:5020], shared + ids[6000:6030], ids[1000:1700]   # two questions, a filler


def make(loaded, path=None, dtype="fp16", **kw) -> LLM:
    per_block = ModelRunner.bytes_per_block(loaded.model, 16, EngineConfig(kv_cache_dtype=dtype).torch_kv_dtype)
    if path is not None:
        kw["kv_offload_dir"] = str(path)
    return LLM(loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory=POOL_BLOCKS * per_block,
               kv_cache_dtype=dtype, **kw)


def run(llm: LLM, prompt: list[int], salt: str | None = None):
    eng = llm.engine
    rid = f"r{eng.core.num_steps}-{len(eng.outputs.requests)}-{salt}"
    eng.add_request(rid, {"prompt_token_ids": prompt}, SP, cache_salt=salt)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                final = out
    return final


def flushed(llm: LLM) -> dict:
    llm.engine.core.offload.store.flush()
    return llm.stats()


@pytest.fixture(scope="module")
def cold(loaded, prompts):
    """The second question's greedy answer computed from scratch, per KV dtype."""
    return {d: run(make(loaded, dtype=d, enable_prefix_caching=False), prompts[1]).outputs[0].token_ids
            for d in ("fp16", "int8")}


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_evicted_prefix_comes_back_from_disk_then_after_restart(loaded, prompts, cold, tmp_path, dtype):
    first, second, filler = prompts
    llm = make(loaded, tmp_path, dtype)
    run(llm, first)
    run(llm, filler)                                   # the pool is too small for both: the prefix is evicted
    assert flushed(llm)["kv_offload_written_blocks"] >= SHARED // 16
    out = run(llm, second)
    st = llm.stats()
    assert st["kv_offload_hit_blocks"] > 0
    assert out.num_cached_tokens == SHARED // 16 * 16
    assert out.outputs[0].token_ids == cold[dtype]

    again = make(loaded, tmp_path, dtype)               # a restart on the same directory
    out = run(again, second)
    assert again.stats()["kv_offload_hit_blocks"] == out.num_cached_tokens // 16 >= SHARED // 16
    assert out.outputs[0].token_ids == cold[dtype]


def test_a_chain_longer_than_a_step_budget_lands_over_steps(loaded, prompts, cold, tmp_path):
    first, second, _ = prompts
    run(make(loaded, tmp_path), first)
    llm = make(loaded, tmp_path, max_step_ms=1e-6)     # one block per step
    steps = []
    begin = llm.engine.core.offload.begin_step
    llm.engine.core.offload.begin_step = lambda: (steps.append(1), begin())
    out = run(llm, second)
    assert out.num_cached_tokens == SHARED // 16 * 16
    assert llm.stats()["kv_offload_hit_blocks"] == SHARED // 16
    assert len(steps) > SHARED // 16
    assert out.outputs[0].token_ids == cold["fp16"]


def _first_block_file(llm: LLM, prompt: list[int]):
    core = llm.engine.core
    req = EngineCoreRequest(request_id="x", prompt_token_ids=prompt, sampling_params=SP, arrival_time=0.0)
    return core.offload.store.path(prompt_block_hashes(core.kv, req, 1)[0])


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign"])
def test_a_bad_block_file_is_a_miss_and_deleted(loaded, prompts, cold, tmp_path, damage):
    first, second, _ = prompts
    llm = make(loaded, tmp_path / "a")
    run(llm, first)
    flushed(llm)
    f = _first_block_file(llm, second)
    raw = bytearray(f.read_bytes())
    if damage == "corrupt":
        raw[len(raw) // 2] ^= 0xFF
    elif damage == "truncated":
        raw = raw[:len(raw) - 100]
    else:                                               # the same block from a store of int8 KV
        other = make(loaded, tmp_path / "b", "int8")
        run(other, first)
        flushed(other)
        raw = _first_block_file(other, second).read_bytes()
    f.write_bytes(raw)
    again = make(loaded, tmp_path / "a")
    out = run(again, second)
    st = again.stats()
    assert st["kv_offload_bad_blocks"] == 1 and st["kv_offload_hit_blocks"] == 0
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == cold["fp16"]
    flushed(again)
    assert f.exists()                                   # rewritten by the cold computation, whole this time
    assert DiskKVStore._verify(again.engine.core.offload.store, f.read_bytes(), bytes.fromhex(f.stem),
                               again.engine.core.offload.shape, "float16") is not None


def test_two_cache_salts_never_read_each_others_blocks(loaded, prompts, tmp_path):
    first, second, _ = prompts
    llm = make(loaded, tmp_path)
    run(llm, first, salt="alice")
    flushed(llm)
    again = make(loaded, tmp_path)
    out = run(again, second, salt="bob")
    assert out.num_cached_tokens == 0 and again.stats()["kv_offload_hit_blocks"] == 0
    out = run(make(loaded, tmp_path), second, salt="alice")
    assert out.num_cached_tokens == SHARED // 16 * 16


def test_another_model_or_format_is_ignored_with_one_line(loaded, prompts, tmp_path, caplog):
    first, second, _ = prompts
    llm = make(loaded, tmp_path, "int8")
    run(llm, first)
    flushed(llm)
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        fp16 = make(loaded, tmp_path)
    assert sum("of another model or KV format" in r.message for r in caplog.records) == 1
    assert run(fp16, second).num_cached_tokens == 0
    assert fp16.stats()["kv_offload_read_blocks"] == 0


def test_a_full_disk_degrades_to_ram_only_with_one_warning(loaded, prompts, cold, tmp_path, monkeypatch, caplog):
    first, second, _ = prompts

    def full(p, parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskKVStore, "_write_file", staticmethod(full))
    llm = make(loaded, tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        run(llm, first)
        st = flushed(llm)
        out = run(llm, second)                          # still served, from RAM
    assert sum("RAM-only" in r.message for r in caplog.records) == 1
    assert st["kv_offload_written_blocks"] == 0 and not llm.engine.core.offload.store.writable
    assert out.num_cached_tokens == SHARED // 16 * 16
    assert out.outputs[0].token_ids == cold["fp16"]


def test_a_tiny_size_writes_nothing(loaded, prompts, cold, tmp_path):
    first, second, _ = prompts
    llm = make(loaded, tmp_path, kv_offload_size=1000)
    run(llm, first)
    assert flushed(llm)["kv_offload_bytes"] == 0
    assert run(llm, second).outputs[0].token_ids == cold["fp16"]


def test_close_writes_what_the_last_step_noted(loaded, ids, tmp_path):
    """The blocks filled by a request's last step are written at the next step's start: with no
    next step (a server stopping), closing the engine writes them."""
    llm = make(loaded, tmp_path)
    core = llm.engine.core
    for n in range(330, 346):      # a length whose last decode step fills a block
        run(llm, ids[7000:7000 + n])
        if core.kv.offload_pending:
            break
    pending = len(core.kv.offload_pending)
    assert pending > 0
    store = core.offload.store
    before = flushed(llm)["kv_offload_written_blocks"]
    core.close()
    assert store.written_blocks == before + pending
    assert core.offload is None and core.kv.offload is None and core.runner.offload is None
    core.close()                   # idempotent

def test_the_last_steps_blocks_reach_the_disk_when_the_store_closes(loaded, prompts, tmp_path):
    """A prompt answered in one step: its blocks, noted for the next step's save, are written when
    the engine stops (a warm restart would otherwise miss the end of the last prompt)."""
    first, _, _ = prompts
    llm = make(loaded, tmp_path)
    llm.generate([{"prompt_token_ids": first}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    store = llm.engine.core.offload.store
    store.close()
    assert store.written_blocks == len(first) // 16
