"""The sentence encoder's work charged to the caller's key, as a generation is: the encoder's
tokens counted first (on its thread, before any forward) and capped by `--max-embedding-tokens`
(400 naming `param`), reserved from the key's token bucket (generation/lease.py's `Reservation`:
429 when the bucket cannot hold them), and written to the usage ledger once encoded.

Every caller of the encoder on a key's behalf goes through `charged_encode`: /v1/embeddings and
Ollama's /api/embed (api/embeddings.py), /v1/rerank and /v1/score (api/rerank.py), and the Batch
API's embedding lines (generation/batch_runner.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.errors import InvalidRequest, KVServeError, Overloaded
from kvserve.server.generation.lease import Reservation

if TYPE_CHECKING:
    from kvserve.server.app import ServerState
    from kvserve.server.records import RequestRecord


async def charged_encode(gw: ServerState, record: RequestRecord, texts: list[str], use: str = "api",
                         param: str = "input"):
    """([n, dim] unit rows, tokens) of `texts` from the server's encoder, charged to the record's key."""
    embedder, cap = gw.routing.embedder, gw.settings.max_embedding_tokens
    try:
        tokens = sum(await embedder.token_counts(texts))
        if tokens > cap:
            raise InvalidRequest(f"{param} holds {tokens} tokens; at most {cap} per request: send fewer or "
                                 "shorter inputs per request.", param=param)
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
