"""A prefix fetched from another replica (engine/disagg.py's `export_prefix` and import), in process
with the real model: the blocks one engine holds in RAM, or only on its disk tier, land in another
engine's prefix cache and its greedy answer equals a cold run token for token; a payload of another
model, a damaged one or one whose hashes are not the request's own is a miss. Also what a replica
reports of its tiers (engine/ray_replica.py's `replica_tier`): engines sharing a directory report
the same disk store."""

from __future__ import annotations

import msgspec
import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.disagg import KVTransfer, decode_payload, encode_payload, prompt_block_hashes
from kvserve.engine.messages import EngineCoreRequest
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.ray_replica import replica_tier
from kvserve.train.data import load_corpus

SHARED = 320                      # 20 blocks
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(loaded):
    ids = loaded.tokenizer.encode(load_corpus(max_chars=40_000))
    return ids[:SHARED] + ids[5000:5020], ids[:SHARED] + ids[6000:6030]


def engine(loaded, path=None, **kw) -> LLM:
    per_block = ModelRunner.bytes_per_block(loaded.model, 16, EngineConfig().torch_kv_dtype)
    if path is not None:
        kw["kv_offload_dir"] = str(path)
    return LLM(loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory=64 * per_block, **kw)


def answer(llm: LLM, prompt: list[int]):
    return llm.generate({"prompt_token_ids": prompt}, SP, use_tqdm=False)[0]


def request(prompt: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(request_id="fetched", prompt_token_ids=prompt, sampling_params=SP, arrival_time=0.0)


def export(llm: LLM, prompt: list[int]) -> bytes:
    """What a donor replica answers `export_prefix` (its core's part run here, between steps)."""
    t = KVTransfer(llm.engine.core, "serve")
    return t.export_prefix(request(prompt), (len(prompt) - 1) // 16, lambda job: t.on_inputs([job]))


def land(llm: LLM, payload: bytes, prompt: list[int]) -> KVTransfer:
    t = KVTransfer(llm.engine.core, "serve")
    item = decode_payload(payload)
    item.requests.append(request(prompt))
    assert t.on_inputs([item]) == item.requests        # the request goes on behind its blocks
    return t


@pytest.fixture(scope="module")
def cold(loaded, prompts):
    return answer(engine(loaded, enable_prefix_caching=False), prompts[1]).outputs[0].token_ids


def test_a_prefix_fetched_from_another_engines_ram_answers_as_a_cold_run(loaded, prompts, cold):
    first, second = prompts
    donor = engine(loaded)
    answer(donor, first)
    payload = export(donor, second)
    assert len(decode_payload(payload).header.hashes) == SHARED // 16
    taker = engine(loaded)
    t = land(taker, payload, second)
    assert t.imported_blocks == SHARED // 16
    out = answer(taker, second)
    assert out.num_cached_tokens == SHARED
    assert out.outputs[0].token_ids == cold


def test_a_prefix_only_on_the_donors_disk_tier_is_fetched_too(loaded, prompts, cold, tmp_path):
    first, second = prompts
    donor = engine(loaded, tmp_path)
    answer(donor, first)
    core = donor.engine.core
    core.offload.store.flush()
    core.kv.reset_prefix_cache()                        # RAM forgot it: only the disk holds it
    payload = export(donor, second)
    assert len(decode_payload(payload).header.hashes) == SHARED // 16
    assert core.offload.store.read_blocks == SHARED // 16
    taker = engine(loaded)
    land(taker, payload, second)
    out = answer(taker, second)
    assert out.num_cached_tokens == SHARED
    assert out.outputs[0].token_ids == cold


def test_another_model_a_damaged_payload_or_foreign_hashes_land_nothing(loaded, prompts, cold):
    first, second = prompts
    donor = engine(loaded)
    answer(donor, first)
    payload = export(donor, second)
    item = decode_payload(payload)
    other_model = msgspec.structs.replace(item.header, model_hash="0" * 32)
    damaged = bytearray(item.data)
    damaged[len(damaged) // 2] ^= 0xFF
    foreign = [7] * 16 + second[16:]                    # its first block differs: so does every hash
    taker = engine(loaded)
    for header, data, prompt in ((other_model, item.data, second), (item.header, bytes(damaged), second),
                                 (item.header, item.data, foreign)):
        t = land(taker, encode_payload(header, data), prompt)
        assert t.imported_blocks == 0 and t.rejected_blocks == SHARED // 16
    out = answer(taker, second)
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == cold


def test_engines_sharing_a_directory_report_one_disk_store(loaded, prompts, tmp_path):
    first, _ = prompts
    a, b, c = engine(loaded, tmp_path / "shared"), engine(loaded, tmp_path / "shared"), engine(loaded, tmp_path / "x")
    answer(a, first)
    a.engine.core.offload.store.flush()
    ta, tb, tc = (replica_tier(x.engine.core, "node1") for x in (a, b, c))
    assert ta["disk"] == tb["disk"] != tc["disk"] and ta["disk"].startswith("node1:")
    assert ta["ram_blocks"] > 0 and ta["disk_blocks"] > 0
    h0 = prompt_block_hashes(a.engine.core.kv, request(first), 1)[0]
    assert h0 in ta["held"] and len(ta["held"]) >= SHARED // 16
    assert replica_tier(engine(loaded).engine.core, "node1")["disk"] is None
