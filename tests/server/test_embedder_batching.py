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
