"""How many tokens a long prompt gets in a step (the scheduler's third pass; its module docstring
says the rules): the step-time target, the loan the streams' steps make to long prompts, and the
growth cap between one chunk and the next.

`open_step` sets the step's time limit once the decodes and short prompts are scheduled; `chunk`
cuts one long prompt's tokens to it; `close_step` keeps what is left of the loan; `observe` pays
the loan back from the step's measured time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.engine.messages import ScheduledRequest
from kvserve.engine.request import Request
from kvserve.engine.step_cost import StepCostModel


@dataclass(slots=True)
class StepBudget:
    """What one `schedule()` call has left and has learned so far (made there, dropped after)."""

    tokens: int                       # of max_num_batched_tokens, not yet handed out
    preempted: bool = False           # a running request lost its blocks this step
    pool_short: bool = False          # an admission found the block pool short
    with_decodes: bool = False        # long chunks are paid by the streams' loan (scheduler docstring)
    step_limit: float = math.inf      # predicted seconds the step may take (with max_step_ms)


def _chunks(scheduled: Sequence[ScheduledRequest]) -> list[tuple[int, int]]:
    return [(s.num_computed_tokens, s.num_new_tokens) for s in scheduled]


class LongPrefillPacer:
    def __init__(self, cost: StepCostModel, block_size: int, threshold: int, max_step_s: float | None,
                 max_decode_slowdown: float):
        self.cost = cost
        self.block_size = block_size
        self.threshold = threshold                      # a long prompt's share of a shared step
        self.max_step_s = max_step_s
        self.max_decode_slowdown = max_decode_slowdown
        self._last_chunk: dict[str, int] = {}           # long prompts' previous chunk (the growth cap)
        self._credit = 0.0                              # seconds the streams' steps lend long prompts
        self._one_token = 0.0                           # ... and what the first one's next token costs
        self._loan: tuple[float, float] | None = None  # this step's (time without long chunks, cap)
        self._earn = 0.0                                # what this step's decodes lent
        self._base = 0.0                                # this step's predicted time before long chunks

    def open_step(self, budget: StepBudget, scheduled: Sequence[ScheduledRequest], decodes: Sequence[Request],
                  alone: bool) -> None:
        """The step's time limit for long chunks: the time the streams lend them, else the target
        or 2x the step without them (`alone`, a prompt alone in the engine: 4x)."""
        budget.with_decodes = bool(decodes) and self.max_decode_slowdown > 0 and self.max_step_s is not None
        self._earn = 0.0
        if self.max_step_s is None:
            return
        self._base = self.cost.predict(_chunks(scheduled))
        if budget.with_decodes:
            # Each step with decodes lends the long prompts (max_decode_slowdown - 1) x its
            # predicted time; the step then pays back what it really took beyond that prediction
            # (observe), so a misjudged chunk is paid for by the next ones. A chunk too dear for one
            # step (one token deep in a long context) waits a step or two while the loan grows: the
            # streams' steps average at most max_decode_slowdown x their time, and the long prompt
            # always moves. (Lent on the decodes' share only: a step that also prefills a new short
            # prompt lends no more, so that request's first token does not wait for a long chunk.)
            mine = {id(r) for r in decodes}
            self._earn = (self.max_decode_slowdown - 1) * self.cost.predict(
                _chunks([s for s in scheduled if id(s.request) in mine]))
            self._credit += self._earn
            budget.step_limit = self._base + max(0.0, self._credit)
        else:
            self._credit = 0.0
            budget.step_limit = max(self.max_step_s, (4 if alone else 2) * self._base)

    def chunk(self, budget: StepBudget, scheduled: Sequence[ScheduledRequest], req: Request, first: bool,
              start: int, alone: bool) -> int:
        """Tokens of a long prompt for this step from position `start` (past its prefix-cache hit
        when admitted): its share of the budget, cut to the step-time target. `first`: the first
        long prompt in line (it gets at least a block in a step without decodes)."""
        n = min(req.num_prompt_tokens - start, budget.tokens)
        if not alone:                                  # a share of the step, so others get in beside it
            n = min(n, self.threshold)
        if self.max_step_s is not None and n > 0:
            chunks = _chunks(scheduled)
            fit = self.cost.max_new_tokens(chunks, start, budget.step_limit, n)
            if first and budget.with_decodes:           # what the next token costs (the loan's cap)
                self._one_token = self.cost.predict(chunks + [(start, 1)]) - self.cost.predict(chunks)
            last = self._last_chunk.get(req.request_id)
            if last is not None:                        # grow by at most 2x a step (or one block)
                fit = min(fit, max(2 * last, self.block_size))
            floor = 0 if budget.with_decodes else self.block_size    # (with decodes: the loan grows)
            n = max(fit, min(n, floor) if first else 0)
            if n > 0:
                self._last_chunk[req.request_id] = n
        return n

    def close_step(self, budget: StepBudget, wanted: bool) -> None:
        """After the long pass: `wanted`, a long prompt was offered a chunk this step."""
        self._loan = None
        if budget.with_decodes:
            # kept only while a long prompt waits for it, and never more than its next token needs
            # (or a few steps' worth): a prompt held back for other reasons gets no burst later
            cap = max(4 * self._earn, self._one_token + self._earn)
            self._credit = min(cap, self._credit) if wanted else 0.0
            if wanted:
                self._loan = (self._base, cap)

    def observe(self, seconds: float) -> None:
        """Pay back the streams' loan: the step's time beyond its predicted time without long chunks."""
        if self._loan is not None and math.isfinite(seconds):
            base, cap = self._loan
            self._credit = max(-cap, self._credit - (seconds - base))
            self._loan = None

    def forget(self, request_id: str) -> None:
        self._last_chunk.pop(request_id, None)
