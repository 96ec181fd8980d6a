"""The sentence encoder's work charged to the caller's key, as a generation is: the encoder's
tokens counted first (on its thread, before any forward) and capped by `--max-embedding-tokens`
(400 naming `param`; counted in slices of about `COUNT_SLICE_CHARS` characters that stop at the
first one past the cap, so an oversized request costs no more counting than the largest one
allowed, and the encoder's thread is free between slices), reserved from the key's token bucket (generation/lease.py's `Reservation`:
429 when the bucket cannot hold them), and written to the usage ledger once encoded.

Every caller of the encoder on a key's behalf goes through `charged_encode`: /v1/embeddings and
Ollama's /api/embed (api/embeddings.py), /v1/rerank and /v1/score (api/rerank.py), and the Batch
API's embedding lines (api/batch_runner.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.errors import InvalidRequest, KVServeError, Overloaded
from kvserve.server.generation.lease import Reservation

if TYPE_CHECKING:
    from kvserve.server.records import RequestRecord
    from kvserve.server.routing.embedder import Embedder
    from kvserve.server.state import ServerState

COUNT_SLICE_CHARS = 16_384   # about 4,000 tokens: one slice is a few tens of milliseconds of counting


async def count_within(embedder: Embedder, texts: list[str], cap: int, param: str) -> int:
    """The encoder's tokens of `texts`, counted a slice at a time; a 400 naming `param` as soon as
    they pass `cap`."""
    tokens, start = 0, 0
    while start < len(texts):
        end, chars = start, 0
        while end < len(texts) and (end == start or chars + len(texts[end]) <= COUNT_SLICE_CHARS):
            chars += len(texts[end])
            end += 1
        tokens += sum(await embedder.token_counts(texts[start:end]))
        if tokens > cap:
            held = "" if end == len(texts) else f" (in its first {end} of {len(texts)} inputs)"
            raise InvalidRequest(f"{param} holds {tokens} tokens{held}; at most {cap} per request: send fewer "
                                 "or shorter inputs per request.", param=param)
        start = end
    return tokens


async def charged_encode(gw: ServerState, record: RequestRecord, texts: list[str], use: str = "api",
                         param: str = "input"):
    """([n, dim] unit rows, tokens) of `texts` from the server's encoder, charged to the record's key."""
    embedder, cap = gw.routing.embedder, gw.settings.max_embedding_tokens
    try:
        tokens = await count_within(embedder, texts, cap, param)
        reservation = Reservation.take(gw, record, tokens, param=param)
        try:
            vecs, tokens = await embedder.encode(texts, use)
        except BaseException:
            reservation.refund(0)
            raise
        await reservation.settle(tokens)
    except (KVServeError, OSError) as e:   # the weights package missing or broken: the server stays up
        if isinstance(e, KVServeError) and e.status < 500:
            raise
        raise Overloaded(f"The embedding model could not be loaded: {getattr(e, 'message', e)}", retry_after=30.0,
                         code="model_not_ready") from None
    return vecs, tokens
