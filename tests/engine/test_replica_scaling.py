"""Replicas that scale (engine/replica_supervisor.py) on Ray's local cluster with the real default
model: `replicas="1:2"` starts one replica, adds the second under a load that misses the TTFT
target, keeps answering every request while it scales, and drains back to one when idle.
Also the supervisor's pure parts: `--replicas` parsing and the router's drained slots."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvserve.engine.client import make_engine_client
from kvserve.engine.ray_cluster import parse_replicas
from kvserve.engine.replica_router import PrefixAffinityRouter
from kvserve.errors import InvalidRequest
from kvserve.sampling_params import SamplingParams

ray = pytest.importorskip("ray")


def test_replicas_parse_as_count_or_range():
    assert parse_replicas(2) == (2, 2)
    assert parse_replicas("3") == (3, 3)
    assert parse_replicas("1:4") == (1, 4)
    for bad in ("0", "2:1", "a:b", "1:2:3", "", ":", 0, True, None):
        with pytest.raises(InvalidRequest, match="replicas must"):
            parse_replicas(bad)


def test_drained_slot_takes_nothing_new_and_revives_empty():
    r = PrefixAffinityRouter(2, 4)
    prompt = list(range(32))
    first = r.route(prompt)
    r.drain(first)
    assert {r.route(list(range(s, s + 16))) for s in range(0, 4000, 100)} == {1 - first}
    assert r.replicas[first].in_flight == 1                  # what it holds still counts until done
    r.revive(first)
    assert r.replicas[first].accepting and r.replicas[first].in_flight == 0 and not r.replicas[first].seen
    r.slot(4)                                                # a new slot: present, not alive until revived
    assert [x.alive for x in r.replicas] == [True, True, False, False, False]
    r.revive(4)
    assert 4 in r.alive()


def test_one_to_two_replicas_scale_up_under_load_and_down_when_idle(ray_cluster):
    client = make_engine_client(None, replicas="1:2", target_ttft_ms=1, replica_idle_seconds=3,
                                kv_cache_memory="64MiB", max_model_len=512)
    tok = client.tokenizer
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = tok.encode("Explain, in plain words and with one example, how tides work. " * 6)

    async def main():
        await client.start()
        assert client.replica_states()["serving"] == 1
        done: list[int] = []
        seen_states: list[dict] = []

        async def one(i: int) -> None:
            async for out in client.generate(prompt + tok.encode(f" Variant {i}."), params, f"r{i}"):
                pass
            done.append(len(out.outputs[0].token_ids))

        i = 0
        t0 = time.monotonic()
        while client.replica_states()["serving"] < 2 and time.monotonic() - t0 < 300:
            await asyncio.gather(*(one(i + k) for k in range(6)))      # a TTFT far above 1 ms
            i += 6
            seen_states.append(client.replica_states())
        up = client.replica_states()
        await asyncio.gather(*(one(i + k) for k in range(8)))          # both serve
        per_replica = [r["prefix_cache_queries"] for r in client.stats()["replicas"]]
        t1 = time.monotonic()
        while client.replica_states()["serving"] > 1 and time.monotonic() - t1 < 120:
            await asyncio.sleep(0.2)
        for _ in range(100):            # the drained one stops once it holds nothing
            if client.replica_states()["stopped"] == 1:
                break
            await asyncio.sleep(0.2)
        down = client.replica_states()
        after = [o async for o in client.generate(prompt, params, "after")]
        return done, i + 8, seen_states, up, per_replica, down, after, client.stats()

    try:
        done, sent, seen_states, up, per_replica, down, after, stats = asyncio.run(main())
    finally:
        asyncio.run(client.shutdown())
    assert len(done) == sent and set(done) == {16}                     # no request lost while scaling
    assert up["serving"] == 2, seen_states
    assert any(s["starting"] == 1 for s in seen_states) or stats["replica_scale_ups"] == 1
    assert all(q > 0 for q in per_replica), per_replica                # the new replica took work
    assert down["serving"] == 1 and down["stopped"] == 1, down
    assert stats["replica_scale_ups"] == 1 and stats["replica_scale_downs"] == 1
    assert len(after[-1].outputs[0].token_ids) == 16
