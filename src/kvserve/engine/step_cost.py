"""How long a step will take, learned from the steps already run (the scheduler's time budget).

A step's forward time is close to linear in three things the scheduler knows before it runs it:

    seconds ≈ c0 + c_tok · tokens + c_row · rows + c_att · Σ_rows new_tokens · (context + new_tokens / 2)

tokens for the projections and the MLP, rows for the per-sequence work (sampling, the lm head), and
the last term for attention, which grows with how much context each new token attends to (so one
token of a prompt at position 7,000 costs many times a token at position 100). The coefficients
are fitted by non-negative least squares, ridge-pulled towards the starting guesses so the first
steps on a new machine are already sensible, and the scheduler asks `max_new_tokens` how big a
prompt chunk still fits under its target step time.

Old steps are forgotten only along the direction of each new step's features (directional
forgetting): a long prompt prefilling beside the same four streams for a thousand steps repeats
one shape of step, which says nothing new about a step of decodes alone, so what was learned
about those steps stays. Forgetting uniformly, as before, let such a run drift the split between
the fixed cost and the attention term until a step of four decodes was predicted at four times
its real cost (BENCHMARKS.md, issue 24).
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
# How much belief each guess carries (as a sum of squared features): a few steps' worth, so steps
# seen on this machine soon outweigh them.
_PRIOR_WEIGHT = np.array([1e-2, 20.0, 2.0, 1e5])
_FORGET = 0.97       # per step, of the information along the new step's direction
_BATCH = 8           # steps learnt from at once (observe)


def _nnls(P: np.ndarray, r: np.ndarray, c: np.ndarray) -> np.ndarray:
    """argmin over c >= 0 of c'Pc - 2r'c (P positive definite), from the unconstrained solution c:
    drop negative coefficients and solve again on the rest, until none is negative (at most one
    pass per coefficient)."""
    free = np.ones(len(c), dtype=bool)
    while (c[free] < 0).any():
        free &= c >= 0
        c = np.zeros(len(c))
        idx = np.flatnonzero(free)
        if len(idx):
            c[idx] = np.linalg.solve(P[np.ix_(idx, idx)], r[idx])
    return np.maximum(c, 0.0)


class StepCostModel:
    def __init__(self) -> None:
        self._prior = np.diag(_PRIOR_WEIGHT)
        self._info = np.zeros((4, 4))          # the steps' information beyond the prior (X'X, forgotten)
        self._raw = _PRIOR.copy()               # the unconstrained least-squares solution
        self.coef = _PRIOR.copy()
        self.num_observed = 0                   # steps folded into the fit
        self._pending: list[tuple[list[tuple[int, int]], float]] = []

    @property
    def coef(self) -> np.ndarray:
        return self._coef

    @coef.setter
    def coef(self, value: np.ndarray) -> None:
        self._coef = value
        # as Python floats: the speculative decoder prices a step of decodes every step, right after
        # a forward, where each numpy call costs ~10 us (decode_step_seconds)
        self.coef_floats = tuple(float(c) for c in value)

    def decode_step_seconds(self, contexts: list[int]) -> float:
        """predict() for a step of one new token per row at these contexts, in plain floats."""
        c0, c_tok, c_row, c_att = self.coef_floats
        R = len(contexts)
        return c0 + (c_tok + c_row) * R + c_att * (sum(contexts) + 0.5 * R)

    @staticmethod
    def features(chunks: list[tuple[int, int]]) -> np.ndarray:
        """chunks: (context already computed, new tokens) per scheduled row."""
        tokens = sum(n for _, n in chunks)
        attn = sum(n * (c + n / 2) for c, n in chunks)
        return np.array([1.0, tokens, len(chunks), attn])

    def predict(self, chunks: list[tuple[int, int]]) -> float:
        return float(self.features(chunks) @ self.coef)

    def observe(self, chunks: list[tuple[int, int]], seconds: float) -> None:
        """Learn from a step: queued, and folded into the fit `_BATCH` steps at a time (same order,
        same arithmetic). A step's few numpy calls right after a forward, which has just streamed the
        weights through the caches, took 0.15-0.19 ms (15 us when warm): 5% of a decode step, paid
        once per `_BATCH` steps now. The fit lags by fewer than `_BATCH` steps."""
        if not chunks or not math.isfinite(seconds) or seconds <= 0:
            return
        self._pending.append((chunks, seconds))
        if len(self._pending) >= _BATCH:
            self.flush()

    def flush(self) -> None:
        """Fold the queued steps into the fit."""
        pending, self._pending = self._pending, []
        for chunks, seconds in pending:
            self._fold(self.features(chunks), seconds)

    def _fold(self, x: np.ndarray, seconds: float) -> None:
        info = self._info
        ix = info @ x
        q = float(x @ ix)
        if q > 0:                               # forget along x only, keeping the estimate
            info = info - (1 - _FORGET) * np.outer(ix, ix) / q
        # r = P raw before the new step (so forgetting alone moves nothing), then the step itself
        r = (self._prior + info) @ self._raw + x * seconds
        self._info = info + np.outer(x, x)
        P = self._prior + self._info
        self._raw = np.linalg.solve(P, r)
        self.coef = _nnls(P, r, self._raw)     # no negative costs, whatever the noise says
        self.num_observed += 1

    def max_new_tokens(self, chunks: list[tuple[int, int]], context: int, limit: float, cap: int) -> int:
        """Most new tokens (<= cap) a prompt at `context` may add to a step holding `chunks` so the
        predicted step time stays under `limit` seconds (0 if even one token does not fit)."""
        _, c_tok, c_row, c_att = self.coef
        # predict() of the rows already in the step includes the step's fixed cost c0 (an empty
        # step's is c0 alone): the prompt adds a row and its tokens. (Counting c0 again for an
        # empty step left a lone prompt no time at all once c0 reached half the limit: a loaded
        # machine's steps then held one block each, 351 steps for 6,000 tokens, BENCHMARKS.md
        # issue 51.)
        spare = limit - self.predict(chunks) - c_row
        if spare <= 0:
            return 0
        # c_tok·n + c_att·n·(context + n/2) <= spare: the positive root of a quadratic in n
        a, b = c_att / 2, c_tok + c_att * context
        if a > 0:
            n = (-b + math.sqrt(b * b + 4 * a * spare)) / (2 * a)
        else:   # the fit may price tokens at 0 (non-negative least squares on noisy steps): no bound
            n = spare / b if b > 0 else cap
        return max(0, min(cap, int(n))) if math.isfinite(n) else cap
