"""What a generation holds while it runs, and the one place it is given back.

`Lease.acquire` takes over the plan's holds on models on demand (plan.py), takes the key's token
reservation (429) and then an admission slot (waits; 503
when the queue is full; the wait ends if the client hangs up). The run adds the engine requests
and the pumps that merge several prompts' streams. `async with lease:` around the part that
consumes the run gives everything back exactly once however it ends (a complete answer, an error,
the client gone, a cancelled task): engine requests aborted, slot released, unused tokens
refunded, the usage ledger and the semantic cache written, the access-log fields set. A release
called again (a streamed response's background task after its body's own exit) returns at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

import anyio

from kvserve.errors import KVServeError
from kvserve.outputs import RequestOutput
from kvserve.server.gates.admission import Ticket
from kvserve.server.generation.state import Generation
from kvserve.server.routing.step import CachedAnswer

if TYPE_CHECKING:
    from kvserve.server.records import RequestRecord
    from kvserve.server.state import ServerState

logger = logging.getLogger("kvserve.server")
T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]


@dataclass
class Reservation:
    """A key's token reservation (gates/ratelimit.py's tpm bucket) and its settlement: what a
    request did not use goes back to the bucket and what it used goes to the usage ledger. Every
    path that costs tokens holds one: a generation inside its `Lease`, an embeddings request alone
    (api/embeddings.py)."""

    gw: ServerState
    record: RequestRecord
    reserved: int = 0

    @classmethod
    def take(cls, gw: ServerState, record: RequestRecord, tokens: int, param: str = "max_tokens") -> Reservation:
        """Reserve `tokens` from the caller's bucket (429 naming `param` when it cannot hold them)."""
        key = record.key
        return cls(gw, record, gw.limiter.reserve_tokens(record.key_name, key.tpm if key else None, tokens, param))

    def refund(self, used: int) -> None:
        """Give back what was reserved and not used (once)."""
        key = self.record.key
        if self.reserved:
            self.gw.limiter.refund_tokens(self.record.key_name, key.tpm if key else None, self.reserved - used)
            self.reserved = 0

    async def settle(self, prompt: int, completion: int = 0, cached: int = 0, *, ledger: bool = True) -> None:
        """Refund the unused part; write what was used to the usage ledger (never raises)."""
        self.refund(prompt + completion)
        if not ledger:
            return
        try:
            await asyncio.to_thread(self.gw.keystore.record_usage, self.record.key_name, prompt, completion, cached)
        except Exception:
            logger.exception("usage ledger write failed")


class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


def outcome(exc: BaseException | None) -> tuple[int, str | None]:
    """(status, error) for the access log of a request that ended with `exc` (None: success)."""
    if exc is None:
        return 200, None
    if isinstance(exc, KVServeError):
        return exc.status, exc.message
    if isinstance(exc, ClientGone) or not isinstance(exc, Exception):   # hung up, cancelled, closed
        return 499, "client disconnected"
    return 500, repr(exc)


@dataclass
class Lease:
    """The admission slot, the token reservation and the engine work of one generation."""

    gw: ServerState
    gen: Generation
    record: RequestRecord
    ticket: Ticket | None = None
    reservation: Reservation | None = None
    streams: list[AsyncIterator[RequestOutput]] = field(default_factory=list)   # engine.generate() per prompt
    tasks: list[asyncio.Task] = field(default_factory=list)   # pumps merging several prompts' streams
    started: bool = False           # engine requests were sent
    released: bool = False
    status: int = 200               # set by a renderer that answered with an error event
    error: str | None = None

    @classmethod
    async def acquire(cls, gw: ServerState, gen: Generation, record: RequestRecord, receive: Receive) -> Lease:
        """The token reservation, then an admission slot; nothing is held when this raises (the
        plan's holds on models on demand included: 429, 503, a hang-up all give them back). A
        cached answer takes neither."""
        lease = cls(gw, gen, record)
        plan = gen.plan
        try:     # from here on the lease owns the plan's holds: a refusal below gives them back too
            if plan.cached is not None:
                return lease
            lease.reservation = Reservation.take(gw, record, plan.reserve_tokens)
            lease.ticket = await until_disconnected(receive, gw.admission.acquire(plan.priority))
        except BaseException as e:
            await lease.release(outcome(e)[0])
            raise
        plan.timings.gateway_wait_s = lease.ticket.waited_s
        return lease

    def fail(self, status: int, error: str | None) -> None:
        """The answer ended with an error the renderer already sent (an SSE error event)."""
        self.status, self.error = status, error

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.release(*(outcome(exc) if exc is not None else (self.status, self.error)))

    async def release(self, status: int, error: str | None = None) -> None:
        """Give back everything, once; later calls return at once."""
        if self.released:
            return
        self.released = True
        with anyio.CancelScope(shield=True):
            await self._stop_engine_work()
            if self.ticket is not None:
                self.ticket.release()
            for hold in self.gen.plan.holds:    # a model on demand may expire from now on
                hold.release()
            await self._account(status)
        if self.gen.plan.cached is None:
            self.record.generation = self.gen.log(status, error)

    async def _stop_engine_work(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        for stream in self.streams:   # closing a suspended stream aborts its engine request
            with contextlib.suppress(RuntimeError):
                await stream.aclose()
        if self.started:
            for ps in self.gen.prompts:
                if ps.final is None:
                    with contextlib.suppress(Exception):  # already gone is fine
                        await self.gen.plan.model.abort(ps.request_id)

    async def _account(self, status: int) -> None:
        """Refund the unused reservation; write the usage ledger and the semantic cache."""
        gw, gen = self.gw, self.gen
        reservation = self.reservation or Reservation(gw, self.record)   # a cached answer reserved nothing
        await reservation.settle(*gen.usage_counts(), ledger=self.started or gen.plan.cached is not None)
        if not self.started and gen.plan.cached is None:
            return
        if gen.plan.cached is not None:
            return
        answer = _cacheable(gen) if status == 200 else None
        if answer is None:
            return
        try:
            await asyncio.to_thread(gw.routing.store, gen.plan.cache_key, gen.plan.candidate, gen.plan.model.name,
                                    answer)
        except Exception:
            logger.exception("semantic cache write failed")


def _cacheable(gen: Generation) -> CachedAnswer | None:
    """The answer the semantic cache may store: one prompt, one choice, no tool calls or reasoning."""
    if len(gen.prompts) != 1 or len(gen.prompts[0].choices) != 1:
        return None
    ch = gen.prompts[0].choices[0]
    if ch.calls or ch.reasoning:
        return None
    prompt, completion, _ = gen.usage_counts()
    return CachedAnswer(ch.content, ch.token_ids, ch.finish_reason, prompt, completion)


async def until_disconnected(receive: Receive, aw: Awaitable[T]) -> T:
    """Await `aw`, cancelling it (and raising ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(aw)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        result = await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - we only need it stopped
        result = None
    if isinstance(result, Ticket):
        result.release()
    raise ClientGone()
