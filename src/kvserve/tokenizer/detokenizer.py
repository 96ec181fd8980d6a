"""Incremental detokenization with stop strings, for streaming.

Text is confirmed through two offsets into the token list, as vLLM does it: `prefix_offset`
starts a short window of already-confirmed tokens (context, so a tokenizer that drops a
leading space or merges bytes decodes the new tokens as it would in full text), and
`read_offset` is where unconfirmed tokens begin. Each step decodes the window with and without
the new tokens; the difference is new text unless it ends in U+FFFD, which means a UTF-8
character is still split across tokens and must wait for its remaining bytes.

              prefix_offset        read_offset
    ids: ... |  context tokens    |  new tokens  |
    decode(context)            -> "prefix text"
    decode(context + new)      -> "prefix text" + delta

Confirmed text is then fed through an automaton over the stop strings (`stop_matcher.py`;
a match may span tokens and steps), each character once. The output is cut exactly where a
stop string begins (or ends, with include_stop_str_in_output). Deltas hold back the longest
tail that is still the beginning of some stop string (the automaton's state says how long),
so a delta never carries text a later stop match swallows; `flush()` releases it at the end.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from kvserve.tokenizer.stop_matcher import automaton

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens kept as decoding context for the first output tokens


class _Tokenizer(Protocol):
    all_special_ids: set[int]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas that are UTF-8 safe and stop-aware."""

    def __init__(self, tokenizer: _Tokenizer, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: Iterable[str] | str | None = (),
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        self.stop = [s for s in stops if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._stops = automaton(tuple(self.stop)) if self.stop else None
        self._stop_state = 0   # the automaton's state after the confirmed text

        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # A context that itself ends inside a UTF-8 character would shift every delta; drop it.
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""        # confirmed output text (cut at the stop string once one matched)
        self._emitted = 0      # characters of _text already returned as deltas
        self.stop_reason: str | None = None

    # ---- public API ------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """All confirmed output text so far, cut at the stop string (includes held-back text)."""
        return self._text

    @property
    def emitted_text(self) -> str:
        """What the deltas returned so far add up to (== `text` after `flush()`)."""
        return self._text[:self._emitted]

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def add_tokens(self, token_ids: Sequence[int], *, stop_terminated: bool = False) -> str:
        """Append newly generated tokens; return the text that is now safe to stream.

        `stop_terminated=True` says the last token is EOS or a stop_token_id that ends the
        request: its text is left out (as vLLM does) unless include_stop_str_in_output. Call
        `flush()` afterwards as for any finish."""
        if self.stopped:
            return ""
        if stop_terminated and not self.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            self._append(full_text[len(prefix_text):])
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return self._take(final=False)

    def flush(self) -> str:
        """At finish: decode anything still pending (even a broken UTF-8 tail, shown as U+FFFD)
        and release the held-back text."""
        if not self.stopped and self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            full_text = self._decode(self._ids[self._prefix_offset:])
            if len(full_text) > len(prefix_text):
                self._append(full_text[len(prefix_text):])
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._take(final=True)

    # ---- internals -------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _append(self, new_text: str) -> None:
        start = len(self._text)
        self._text += new_text
        if self._stops is None:
            return
        # The first stop to complete wins; of those completing at one character, the longest.
        self._stop_state, end, k = self._stops.feed(self._stop_state, new_text)
        if k >= 0:
            s = self._stops.stops[k]
            end += start
            self._text = self._text[:end if self.include_stop_str_in_output else end - len(s)]
            self.stop_reason = s

    def _take(self, final: bool) -> str:
        end = len(self._text)
        if not final and not self.stopped:
            end -= self._partial_stop_len()
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the text that a stop string begins with."""
        return self._stops.partial_len(self._stop_state) if self._stops is not None else 0
