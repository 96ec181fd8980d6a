"""Token-level stopping: EOS, stop_token_ids, the repetition guard and the length limit.

Stop *strings* live in the detokenizer (`kvserve.tokenizer.detokenizer`), because only text
knows where a string that spans tokens begins.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvserve.sampling_params import SamplingParams


def is_repeating(token_ids: Sequence[int], window: int, repeats: int) -> bool:
    """True if `token_ids` ends with a block of p <= window tokens repeated `repeats` times."""
    n = len(token_ids)
    for p in range(1, window + 1):
        span = p * repeats
        if span > n:
            break
        tail = list(token_ids[n - span:])
        block = tail[span - p:]
        if tail == block * repeats:
            return True
    return False


def check_stop(params: SamplingParams, output_token_ids: Sequence[int], eos_token_ids: Collection[int],
               max_tokens: int | None) -> tuple[str, int | None] | None:
    """Decide whether the request ends after its newest token (the last of `output_token_ids`).

    Returns (finish_reason, stop_reason) or None to keep going: ("stop", None) for EOS,
    ("stop", token_id) for a stop_token_id, ("repetition", None) for the repetition guard,
    ("length", None) at `max_tokens`: the engine passes the smaller of params.max_tokens and
    what is left of the context window. EOS and stop tokens count only once min_tokens are out.
    """
    n = len(output_token_ids)
    if n == 0:
        return None
    token = output_token_ids[-1]
    if n >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            return "stop", None
        if params.stop_token_ids and token in params.stop_token_ids:
            return "stop", token
    guard = params.repetition_guard
    if guard is not None and is_repeating(output_token_ids, guard.window, guard.repeats):
        return "repetition", None
    if max_tokens is not None and n >= max_tokens:
        return "length", None
    return None
