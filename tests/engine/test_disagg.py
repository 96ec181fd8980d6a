"""Disaggregated prefill and decode (engine/disagg.py) with the real default model: a prefill
replica computes each prompt and ships its KV blocks through Ray's object store to a decode
replica, which continues; the greedy answers equal colocated serving token for token on 12
prompts, the decode replica computed only the last partial block of each prompt, and each pool's
time to first token is reported. The payload is bytes: a msgpack header and raw tensor bytes."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvserve.engine.client import make_engine_client
from kvserve.engine.disagg import KVHeader, decode_payload, encode_payload
from kvserve.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
    "Explain why the sky is blue to a child, in two sentences, using one everyday comparison.",
    "def fibonacci(n):", "The three primary colours are", "Translate to French: good morning, my friend.",
    "A recipe for pancakes starts with", "Once upon a time, in a small village by a very old forest, there lived",
    "List the planets of the solar system in order from the sun:", "The quick brown fox",
    "Summarise the plot of Romeo and Juliet in one sentence, without naming the city where it happens.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
pytest.importorskip("ray")


def test_payload_roundtrip_is_header_plus_raw_bytes():
    data = torch.arange(24, dtype=torch.float16)
    payload = encode_payload(KVHeader(request_id="r", block_size=16, dtype="float16", shape=[24],
                                      hashes=[b"\x01" * 16]), data.view(torch.uint8).numpy().tobytes())
    got = decode_payload(payload)
    assert got.header.request_id == "r" and got.header.hashes == [b"\x01" * 16]
    assert torch.equal(torch.frombuffer(bytearray(got.data), dtype=torch.float16), data)


async def generate_all(client, prompts: list[list[int]], tag: str) -> list[list[int]]:
    await client.start()

    async def one(i: int, ids: list[int]) -> list[int]:
        async for out in client.generate(ids, GREEDY, f"{tag}{i}"):
            pass
        return out.outputs[0].token_ids

    return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))


def test_disaggregated_greedy_equals_colocated(ray_cluster):
    disagg = make_engine_client(None, prefill_replicas=1, decode_replicas=1, kv_cache_memory="64MiB")
    try:
        tok = disagg.tokenizer
        prompts = [tok.encode(p) for p in PROMPTS]
        got = asyncio.run(generate_all(disagg, prompts, "d"))
        asyncio.run(asyncio.sleep(0.5))
        stats = disagg.stats()
    finally:
        asyncio.run(disagg.shutdown())
    colocated = make_engine_client(None, kv_cache_memory="64MiB", num_threads=1)
    want = asyncio.run(generate_all(colocated, prompts, "c"))
    asyncio.run(colocated.shutdown())
    assert got == want
    decode = next(r for r in stats["replicas"] if r["role"] == "decode")
    shipped = sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert shipped > 0 and decode["prefix_cache_hits"] == shipped     # every full block came from prefill
    pools = stats["pools"]
    assert pools["prefill"]["requests"] == pools["decode"]["requests"] == len(prompts)
    assert pools["decode"]["itl_count"] == len(prompts) * (GREEDY.max_tokens - 1)
