"""TTFT of a request moved off the Ray replica that holds its prefix (issue 51), with the prefix
fetched from that replica through Ray's object store beside computed again.

    python -m kvserve.bench.replica_fetch_ttft [--shared 3000] [--rounds 2]

Two replicas of the default model on a local Ray cluster (no disk tier: as if on two machines).
Each round: (1) cold: a new shared prefix + question A, routed to replica x; (2) x is marked loaded
past the router's slack, and the same prefix + question B goes to the other replica, which either
fetches x's blocks (`fetch`) or computes them (the router's fetch threshold set out of reach). One
JSON line per request; TTFT is the time to its first token (max_tokens=1, greedy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from kvserve.engine.client import make_engine_client
from kvserve.sampling_params import SamplingParams
from kvserve.train.data import load_corpus

GREEDY = SamplingParams(temperature=0, max_tokens=1)


async def _ttft(client, ids: list[int], rid: str) -> float:
    t0 = time.perf_counter()
    async for out in client.generate(ids, GREEDY, rid):
        if out.outputs[0].token_ids:
            break
    return time.perf_counter() - t0


async def _run(client, shared: int, rounds: int) -> None:
    ids = client.tokenizer.encode(load_corpus(max_chars=(2 * rounds * shared + 200) * 6))
    tail_a, tail_b = ids[-100:-80], ids[-60:-35]
    await client.start()
    for k in range(2 * rounds):
        fetch = k % 2 == 0
        prefix = ids[k * shared:(k + 1) * shared]
        cold = await _ttft(client, prefix + tail_a, f"a{k}")
        x = max(range(len(client.router.replicas)), key=lambda i: len(client.router.replicas[i].seen))
        client.router.replicas[x].in_flight += 50
        client.router.min_fetch_blocks = 2 if fetch else 1 << 30
        try:
            moved = await _ttft(client, prefix + tail_b, f"b{k}")
        finally:
            client.router.replicas[x].in_flight -= 50
        print(json.dumps({"prompt_tokens": shared + len(tail_b), "cold_s": round(cold, 3),
                          "moved": "fetched" if fetch else "computed", "moved_s": round(moved, 3)}), flush=True)
    await asyncio.sleep(0.5)
    print(json.dumps({"kv_prefix_fetches": client.stats()["kv_prefix_fetches"]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=int, default=3000, help="tokens of each shared prefix")
    ap.add_argument("--rounds", type=int, default=2, help="pairs of (fetched, computed) measurements")
    args = ap.parse_args()
    client = make_engine_client(None, replicas=2, kv_cache_memory="128MiB")
    try:
        asyncio.run(_run(client, args.shared, args.rounds))
    finally:
        asyncio.run(client.shutdown())


if __name__ == "__main__":
    main()
