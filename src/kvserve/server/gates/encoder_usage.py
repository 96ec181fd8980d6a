"""The sentence encoder's work charged to the caller's key, as a generation is: a token
reservation in the key's token bucket before the forward (429 when the bucket cannot cover it),
the unused part refunded after, and the real count written to the usage ledger.

Used by /v1/rerank, /v1/score and the Batch API's embedding lines. The reservation is an upper
bound of the encoder's tokens (a WordPiece token covers at least one character, plus [CLS] and
[SEP] per text, and the encoder reads at most `max_len` tokens of a text).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from kvserve.errors import KVServeError, Overloaded

if TYPE_CHECKING:
    from kvserve.server.app import ServerState
    from kvserve.server.records import RequestRecord

logger = logging.getLogger("kvserve.server")
ENCODER_MAX_TOKENS = 512    # what the encoder reads of one text at most


def token_bound(texts: list[str]) -> int:
    """An upper bound of the encoder's tokens for `texts`."""
    return sum(min(len(t) + 2, ENCODER_MAX_TOKENS) for t in texts)


async def charged_encode(gw: ServerState, record: RequestRecord, texts: list[str], use: str = "api"):
    """([n, dim] unit rows, tokens) of `texts` from the server's encoder, charged to the record's key."""
    key = record.key
    tpm = key.tpm if key else None
    reserved = gw.limiter.reserve_tokens(record.key_name, tpm, token_bound(texts))
    tokens = 0
    try:
        vecs, tokens = await gw.routing.embedder.encode(texts, use)
    except (KVServeError, OSError) as e:   # the weights package missing or broken: the server stays up
        raise Overloaded(f"The embedding model could not be loaded: {getattr(e, 'message', e)}", retry_after=30.0,
                         code="model_not_ready") from None
    finally:
        if reserved:
            gw.limiter.refund_tokens(record.key_name, tpm, reserved - tokens)
    try:
        await asyncio.to_thread(gw.keystore.record_usage, record.key_name, tokens, 0, 0)
    except Exception:
        logger.exception("usage ledger write failed")
    return vecs, tokens
