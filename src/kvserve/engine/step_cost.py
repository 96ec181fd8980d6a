"""How long a step will take, learned from the steps already run (the scheduler's time budget).

A step's forward time is close to linear in three things the scheduler knows before it runs it:

    seconds ≈ c0 + c_tok · tokens + c_row · rows + c_att · Σ_rows new_tokens · (context + new_tokens / 2)

tokens for the projections and the MLP, rows for the per-sequence work (sampling, the lm head), and
the last term for attention, which grows with how much context each new token attends to (so one
token of a prompt at position 7,000 costs many times a token at position 100). The coefficients
are fitted by least squares over the recent steps (an exponential forgetting factor, ridge-pulled
towards the starting guesses so the first steps on a new machine are already sensible), and the
scheduler asks `max_new_tokens` how big a prompt chunk still fits under its target step time.
"""

from __future__ import annotations

import math

import numpy as np

# The server's step-time target for long prompts' chunks, measured on a 2-core CPU with the default
# model (BENCHMARKS.md, issue 24): short enough that a new request waits little and streams keep
# their pace, long enough that a prompt prefilled alone loses little to the per-step overhead.
DEFAULT_MAX_STEP_MS = 100.0

# Starting guesses (seconds): a 2-core AVX2 CPU running the default 135M model.
_PRIOR = np.array([3e-3, 1.2e-3, 2e-4, 5e-7])
_PRIOR_WEIGHT = np.array([1.0, 2e3, 2e2, 1e7])   # how many "steps' worth" of belief each guess carries
_FORGET = 0.97


class StepCostModel:
    def __init__(self) -> None:
        self._xtx = np.diag(_PRIOR_WEIGHT.copy())
        self._xty = _PRIOR_WEIGHT * _PRIOR
        self.coef = _PRIOR.copy()
        self.num_observed = 0

    @staticmethod
    def features(chunks: list[tuple[int, int]]) -> np.ndarray:
        """chunks: (context already computed, new tokens) per scheduled row."""
        tokens = sum(n for _, n in chunks)
        attn = sum(n * (c + n / 2) for c, n in chunks)
        return np.array([1.0, tokens, len(chunks), attn])

    def predict(self, chunks: list[tuple[int, int]]) -> float:
        return float(self.features(chunks) @ self.coef)

    def observe(self, chunks: list[tuple[int, int]], seconds: float) -> None:
        if not chunks or not math.isfinite(seconds) or seconds <= 0:
            return
        x = self.features(chunks)
        prior = np.diag(_PRIOR_WEIGHT)
        # forget old steps, but never below the prior's weight
        self._xtx = prior + _FORGET * (self._xtx - prior) + np.outer(x, x)
        self._xty = _PRIOR_WEIGHT * _PRIOR + _FORGET * (self._xty - _PRIOR_WEIGHT * _PRIOR) + x * seconds
        coef = np.linalg.solve(self._xtx, self._xty)
        self.coef = np.maximum(coef, 0.0)      # no negative costs, whatever the noise says
        self.num_observed += 1

    def max_new_tokens(self, chunks: list[tuple[int, int]], context: int, limit: float, cap: int) -> int:
        """Most new tokens (<= cap) a prompt at `context` may add to a step holding `chunks` so the
        predicted step time stays under `limit` seconds (0 if even one token does not fit)."""
        c0, c_tok, c_row, c_att = self.coef
        spare = limit - self.predict(chunks) - (c_row if chunks else c0 + c_row)
        if spare <= 0:
            return 0
        # c_tok·n + c_att·n·(context + n/2) <= spare: the positive root of a quadratic in n
        a, b = c_att / 2, c_tok + c_att * context
        n = spare / b if a <= 0 else (-b + math.sqrt(b * b + 4 * a * spare)) / (2 * a)
        return max(0, min(cap, int(n)))
