"""Prefixes across Ray replicas (engine/ray_client.py, engine/ray_kv_handover.py) with the real
default model on Ray's local cluster:

* without a shared disk store (two machines, as far as the router knows): a request moved off the
  loaded replica that holds its prefix receives those blocks from it through the object store,
  and its greedy answer equals a cold run token for token;
* with one `kv_offload_dir` on one node: both replicas report the same disk store, so the request
  moved off the loaded replica is a disk hit on the other and nothing is fetched."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvserve.engine.client import make_engine_client
from kvserve.sampling_params import SamplingParams

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SHARED = ("You are the archivist of a small mountain observatory. Every answer cites the logbook entry it "
          "comes from, gives the date in full, names the instrument used, and ends with one sentence on what "
          "remains uncertain. The logbook covers comets, variable stars, meteor showers, the weather on the "
          "summit, repairs to the dome, and the visitors who came to look through the great refractor. ") * 2


def prompts(tok) -> tuple[list[int], list[int]]:
    return (tok.encode(SHARED + "Question: when was the dome last repaired?"),
            tok.encode(SHARED + "Question: which comet was seen most often?"))


def shared_blocks(a: list[int], b: list[int], bs: int = 16) -> int:
    n = 0
    while (n + 1) * bs <= len(b) - 1 and a[:(n + 1) * bs] == b[:(n + 1) * bs]:
        n += 1
    return n


async def generate(client, ids: list[int], rid: str, ttft: dict | None = None) -> list[int]:
    t0 = time.perf_counter()
    async for out in client.generate(ids, GREEDY, rid):
        if ttft is not None and rid not in ttft and out.outputs[0].token_ids:
            ttft[rid] = time.perf_counter() - t0
    return out.outputs[0].token_ids


@pytest.fixture(scope="module")
def cold():
    client = make_engine_client(None, kv_cache_memory="64MiB", num_threads=1, enable_prefix_caching=False)
    _, second = prompts(client.tokenizer)

    async def main():
        await client.start()
        try:
            return await generate(client, second, "cold")
        finally:
            await client.shutdown()
    return asyncio.run(main())


def moved_off_a_loaded_holder(client) -> tuple[int, list[int], dict]:
    """Send the first prompt (to x), load x past the router's slack, send the second (to the other,
    y): (y, its answer, the client's stats)."""
    first, second = prompts(client.tokenizer)

    async def main():
        await client.start()
        ttft: dict[str, float] = {}
        await generate(client, first, "first", ttft)
        holders = [i for i, r in enumerate(client.router.replicas) if r.seen]
        assert len(holders) == 1
        x = holders[0]
        client.router.replicas[x].in_flight += 50
        try:
            got = await generate(client, second, "second", ttft)
        finally:
            client.router.replicas[x].in_flight -= 50
        print(f"TTFT: first prompt cold {ttft['first']:.2f} s; second, moved off the holder, "
              f"{ttft['second']:.2f} s ({len(second)} tokens)")
        await asyncio.sleep(0.5)               # the replicas' last stats snapshots
        return x, got, client.stats()

    x, got, stats = asyncio.run(main())
    return 1 - x, got, stats


def test_a_request_moved_off_a_loaded_replica_fetches_its_prefix(ray_cluster, cold):
    client = make_engine_client(None, replicas=2, kv_cache_memory="64MiB")
    try:
        first, second = prompts(client.tokenizer)
        y, got, stats = moved_off_a_loaded_holder(client)
    finally:
        asyncio.run(client.shutdown())
    assert got == cold
    assert stats["kv_prefix_fetches"] == 1
    n = shared_blocks(first, second)
    assert n >= 8
    assert stats["replicas"][y]["prefix_cache_hits"] == n * 16      # every shared block came from x


def test_replicas_sharing_a_directory_read_each_others_disk_blocks(ray_cluster, cold, tmp_path):
    client = make_engine_client(None, replicas=2, kv_cache_memory="64MiB", kv_offload_dir=str(tmp_path))
    try:
        tiers = [(r.disk, r.ram_blocks) for r in client.router.replicas]
        _, got, stats = moved_off_a_loaded_holder(client)
        disk_hits = client.router.disk_hits
    finally:
        asyncio.run(client.shutdown())
    assert tiers[0][0] is not None and tiers[0][0] == tiers[1][0] and tiers[0][1] > 0
    assert got == cold
    assert disk_hits == 1 and stats["kv_prefix_fetches"] == 0     # routed as a disk hit, nothing fetched
