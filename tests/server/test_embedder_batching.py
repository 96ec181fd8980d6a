"""The server's Embedder coalesces concurrent calls into one forward and gives each caller its
own rows and token count, equal to embedding its texts alone."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.server.routing.embedder import Embedder

TEXTS = [["What is the capital of France?"], ["How do I read a file in Rust?", "2+2"], ["hello"],
         ["Which colors does the flag of Peru have?"], ["When was Ada Lovelace born?"], ["x y z"]]


def test_concurrent_calls_share_forwards():
    emb = Embedder()
    alone = [emb.encode_sync(t) for t in TEXTS]

    async def main():
        return await asyncio.gather(*(emb.encode(t, use="router") for t in TEXTS))

    emb.batches = 0
    got = asyncio.run(main())
    assert emb.batches == 1        # all six were waiting when the first forward started
    for (vecs, tokens), (ref, ref_tokens) in zip(got, alone):
        assert tokens == ref_tokens and vecs.shape == ref.shape
        assert float((vecs * ref).sum(1).min()) > 1 - 1e-3


def test_an_error_reaches_every_waiting_call():
    emb = Embedder()

    def broken():
        raise OSError("weights missing")
    emb.get = broken

    async def main():
        return await asyncio.gather(*(emb.encode(t) for t in TEXTS[:3]), return_exceptions=True)

    assert all(isinstance(r, OSError) for r in asyncio.run(main()))
    with pytest.raises(OSError):   # and the next call tries again
        asyncio.run(emb.encode(["again"]))


def test_a_call_cut_by_shutdown_is_a_retryable_503():
    """Calls waiting when the server closes the encoder get 503 `overloaded` with Retry-After, not a
    500 (a soak's big request in flight when its server stopped came back 500)."""
    from kvserve.errors import Overloaded
    emb = Embedder()
    emb.get()
    started = __import__("threading").Event()

    def slow(texts, use, depths=(None,)):
        started.set()
        __import__("time").sleep(0.3)
        return Embedder._encode_counted(emb, texts, use, depths)
    emb._encode_counted = slow

    async def main():
        calls = [asyncio.ensure_future(emb.encode([f"text {i}"] * 40)) for i in range(3)]
        while not started.is_set():
            await asyncio.sleep(0.01)
        emb.close()
        return await asyncio.gather(*calls, return_exceptions=True)

    got = asyncio.run(main())
    assert any(isinstance(r, Overloaded) for r in got), got
    assert all(isinstance(r, (Overloaded, tuple)) for r in got), got
    assert all(r.status == 503 and r.retry_after > 0 for r in got if isinstance(r, Overloaded))
    with pytest.raises(Overloaded):
        asyncio.run(emb.encode(["after"]))


def test_waiting_calls_for_other_depths_get_their_own_forward():
    emb = Embedder()
    full = emb.encode_sync(TEXTS[0])[0]
    shallow = emb.get().encode_depths(TEXTS[0], (2,))[0][2]

    async def main():
        return await asyncio.gather(emb.encode_depths(TEXTS[0], (2,), use="router"),
                                    emb.encode(TEXTS[0]), emb.encode_depths(TEXTS[0], (None, 2), use="router"))

    emb.batches = 0
    (a, _), (b, _), (c, tokens) = asyncio.run(main())
    assert emb.batches == 3 and set(a) == {2} and set(c) == {None, 2}
    assert tokens == emb.get().token_counts(TEXTS[0])[0]
    for got, ref in ((a[2], shallow), (b, full), (c[None], full), (c[2], shallow)):
        assert float((got * ref).sum(1).min()) > 1 - 1e-3


def _recording(emb: Embedder, forwards: list[list[str]], hold=None):
    """Forwards that record their texts and return each text's number as its vector; `hold(texts)`
    runs first (a slice that blocks)."""
    import time

    import torch

    def fake(texts, use, depths=(None,)):
        forwards.append(list(texts))
        if hold is not None:
            hold(texts)
        time.sleep(0.01)
        ids = torch.tensor([float("".join(c for c in t if c.isdigit()) or -1) for t in texts])   # "big7" -> 7
        return {d: ids[:, None].repeat(1, 4) for d in depths}, [1] * len(texts)
    emb._encode_counted = fake


def test_big_calls_take_turns_in_slices():
    """Issue 49.3: a big call is cut into slices, and two big calls take turns (a Batch API line's
    embeddings too: bulk work, not a request-path lookup)."""
    emb = Embedder(slice_texts=4)
    forwards: list[list[str]] = []
    _recording(emb, forwards)
    big = [f"big{i}" for i in range(40)]
    other = [f"other{i}" for i in range(8)]

    async def main():
        first = asyncio.ensure_future(emb.encode(big))
        await asyncio.sleep(0)            # the first slice starts
        second = asyncio.ensure_future(emb.encode(other))
        third = asyncio.ensure_future(emb.encode([f"line{i}" for i in range(8)], use="batch"))
        return await asyncio.gather(first, second, third)

    (vecs, tokens), (vecs2, _), _ = asyncio.run(main())
    assert all(len(f) <= 4 for f in forwards)
    with_big = [i for i, f in enumerate(forwards) if any(t.startswith("big") for t in f)]
    with_other = [i for i, f in enumerate(forwards) if any(t.startswith("other") for t in f)]
    assert with_other[-1] < with_big[-1]                    # the second call did not wait for the first
    assert tokens == 40 and [int(x) for x in vecs[:, 0]] == list(range(40))   # every row its own text's
    assert [int(x) for x in vecs2[:, 0]] == list(range(8))


def test_a_lookup_runs_beside_a_big_calls_slice():
    """A request-path lookup (semantic cache, router, moderation) does not wait for the slice that
    is running: the big call's first forward blocks until the lookup's forward has run, which
    only happens if the lookup has a thread of its own."""
    import threading

    emb = Embedder(slice_texts=4)
    forwards: list[list[str]] = []
    looked_up = threading.Event()
    held: list[bool] = []

    def hold(texts):
        if "the query" in texts:
            looked_up.set()
        elif not held:
            held.append(looked_up.wait(timeout=5))
    _recording(emb, forwards, hold)
    big = [f"big{i}" for i in range(12)]

    async def main():
        first = asyncio.ensure_future(emb.encode(big))
        await asyncio.sleep(0.05)         # the first slice is running (and blocked)
        lookup = asyncio.ensure_future(emb.encode(["the query"], use="semantic_cache"))
        return await asyncio.gather(first, lookup)

    (vecs, tokens), (q, _) = asyncio.run(main())
    assert held == [True]                                   # the lookup ran while the slice waited
    assert ["the query"] in forwards and all("the query" not in f for f in forwards if len(f) > 1)
    assert tokens == 12 and [int(x) for x in vecs[:, 0]] == list(range(12))
    assert int(q[0, 0]) == -1
