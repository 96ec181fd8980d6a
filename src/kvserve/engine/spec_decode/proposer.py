"""Proposers: who guesses a request's next tokens. One interface, asked by the scheduler once per
step for the whole batch of requests that may speculate (a draft model runs them as one batch).

The n-gram proposer is prompt lookup decoding (vLLM's `ngram`, llama.cpp's lookup): the last n
tokens of the sequence (n from `ngram_max` down to `ngram_min`) are searched in the sequence
before them, prompt and output alike, and what followed their latest earlier occurrence is the
guess. It needs no model and costs a few microseconds: the search is `bytes.rfind` over the
token ids packed as int32, aligned to whole tokens. It pays on input-grounded answers (rewriting,
extracting or editing a passage given in the prompt), where the answer copies runs of the prompt.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvserve.engine.request import Request


@dataclass(frozen=True)
class HiddenSink:
    """What a proposer reads from the target's own forward (an EAGLE head's features): the model
    runner, given one at construction, calls `observe(scheduled, hidden, captured)` after every
    step's forward with the final hidden states [T, H] (rows in the order of `scheduled`) and the
    residual stream after `layers`, RMS-normalised, [T, len(layers), H] (None without layers)."""

    observe: Callable[[Sequence[Any], Any, Any], None]
    layers: tuple[int, ...] = ()


class Proposer(Protocol):
    hidden_sink: HiddenSink | None     # None: the proposer reads tokens only

    def propose(self, batch: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """For each (request, k): at most k draft tokens to follow the request's tokens (may be empty)."""
        ...


class NgramProposer:
    hidden_sink = None

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, batch: Sequence[tuple[Request, int]]) -> list[list[int]]:
        return [self.lookup(r.prompt_token_ids + r.output_token_ids, k) for r, k in batch]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix (up to k tokens)."""
        L = len(tokens)
        if k <= 0 or L < self.ngram_min + 1:
            return []
        data = array("i", tokens).tobytes()
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            needle = data[4 * (L - n):]
            end = 4 * (L - 1)          # the match must end before the last token: something follows it
            while True:
                i = data.rfind(needle, 0, end)
                if i < 0:
                    break
                if i % 4 == 0:         # aligned to a token
                    start = i // 4 + n
                    return tokens[start:start + k]
                end = i + len(needle) - 1
        return []
