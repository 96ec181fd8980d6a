"""Admission control: a bounded, prioritised waiting queue in front of the engine.

At most `max_running` requests are inside the engine at once. Others wait here, best priority
first (paid tier before free, then arrival order); the queue holds at most `max_waiting`, and a
request that finds it full is refused at once with 503 + Retry-After instead of piling up.
Before that hard wall, a degradation ladder keyed on the queue length trades quality for
availability in steps: first route requests for the "auto" model to the cheapest model
(`prefers_cheaper`, read by the router), then cap max_tokens (the response says so in a header),
then refuse the free tier, then refuse everyone.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass

from kvserve.errors import Overloaded
from kvserve.server.settings import ServerSettings

TIER_PRIORITY = {"paid": 0, "free": 1}


@dataclass
class LadderDecision:
    max_tokens_cap: int | None = None  # set when the ladder's first rung applies


def ladder_decision(queue_len: int, tier: str, settings: ServerSettings) -> LadderDecision:
    """What the ladder does to a request arriving when `queue_len` requests are already waiting."""
    retry = settings.retry_after_s
    if queue_len >= settings.max_waiting:
        raise Overloaded(f"The server is overloaded ({queue_len} requests waiting). "
                         f"Retry after {retry:g} s.", retry_after=retry)
    if settings.ladder_reject_free_at is not None and queue_len >= settings.ladder_reject_free_at \
            and tier == "free":
        raise Overloaded(f"The server is busy and is serving paid-tier keys only ({queue_len} waiting). "
                         f"Retry after {retry:g} s.", retry_after=retry)
    if settings.ladder_cap_at is not None and queue_len >= settings.ladder_cap_at:
        return LadderDecision(max_tokens_cap=settings.ladder_cap_max_tokens)
    return LadderDecision()


def engine_priority(tier: str, requested: int) -> int:
    """The engine's priority for a request: lower runs first; the tier decides, the request's own
    `priority` orders within a tier."""
    return TIER_PRIORITY.get(tier, 1) * 1_000_000 + max(-100_000, min(100_000, requested))


class Admission:
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.running = 0
        self._heap: list[tuple[int, int, asyncio.Future]] = []
        self._seq = itertools.count()

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, _, fut in self._heap if not fut.done())

    def prefers_cheaper(self, tier: str) -> bool:
        """The ladder's first rung, before any max_tokens cap: past `ladder_route_cheaper_at` waiting
        requests, the router ("auto") sends requests to the cheapest model."""
        at = getattr(self.settings, "ladder_route_cheaper_at", None)
        return at is not None and self.num_waiting >= at

    def check(self, tier: str) -> LadderDecision:
        """Apply the ladder now (raises Overloaded); call before any expensive work."""
        waiting = self.num_waiting
        if self.running < self.settings.max_running and waiting == 0:
            return LadderDecision()
        return ladder_decision(waiting, tier, self.settings)

    async def acquire(self, priority: int) -> Ticket:
        """Wait for one of the `max_running` engine slots (best priority first); raises Overloaded
        if the queue is full. The caller must `release()` the ticket (it is idempotent)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        if self.running < self.settings.max_running and self.num_waiting == 0:
            self.running += 1
            return Ticket(self, 0.0)
        if self.num_waiting >= self.settings.max_waiting:
            raise Overloaded(f"The server is overloaded ({self.num_waiting} requests waiting). "
                             f"Retry after {self.settings.retry_after_s:g} s.",
                             retry_after=self.settings.retry_after_s)
        fut: asyncio.Future = loop.create_future()
        heapq.heappush(self._heap, (priority, next(self._seq), fut))
        try:
            await fut  # _release() hands the slot over (running already counts us)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # the slot was handed to us just as we were cancelled
            else:
                fut.cancel()
            raise
        return Ticket(self, loop.time() - start)

    def _release(self) -> None:
        self.running -= 1
        while self._heap:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                self.running += 1
                fut.set_result(None)
                break


class Ticket:
    """One engine slot, held from admission until the response is complete."""

    def __init__(self, admission: Admission, waited_s: float):
        self.admission = admission
        self.waited_s = waited_s
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.admission._release()
