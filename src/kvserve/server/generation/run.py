"""The one generation path: a plan's prompts through the engine client and each choice's stage
list, as a stream of `ChoiceEvent`s that every API renders in its own wire format.

    run_generation: [forced tool-call opening] → engine.generate() per prompt (several prompts
    merged into one stream) → per output: metrics once a request finishes → each choice's delta
    through its stage list (stages/), accumulated on the Generation → ChoiceEvent

A semantic-cache candidate runs like any request, its stored tokens sent as the engine request's
draft (verified there). With the cache's `verify` off, a cached answer is a source of its own: its text in a few pieces and a
last delta with the stored finish reason, no engine request, no stages. The run's time per
engine output (stages, and the consumer's rendering and write while it holds the event) is
added to `gw.http_ns`, the `http` phase of the profile (state.ServerState.engine_stats).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, NamedTuple

from kvserve.outputs import RequestOutput
from kvserve.server.generation.lease import Lease, Receive, until_disconnected
from kvserve.server.generation.state import Generation, PromptState
from kvserve.server.stages import ChoiceDelta, run_stages

if TYPE_CHECKING:
    from kvserve.server.state import ServerState

CACHED_WORDS_PER_PIECE = 16


class ChoiceEvent(NamedTuple):
    """One step of one choice: its prompt's index, its index within the prompt, what it gained."""

    prompt: int
    choice: int
    delta: ChoiceDelta


async def run_generation(gw: ServerState, gen: Generation, lease: Lease) -> AsyncIterator[ChoiceEvent]:
    """Every choice's deltas, after its stages, until every choice has finished. The engine work
    is registered on `lease`, which stops it however the consumer ends."""
    if gen.plan.cached is not None:
        async for event in _cached(gen):
            yield event
        return
    for pi, ps in enumerate(gen.prompts):    # a forced tool call's opening: the prompt's end, continued
        if ps.prompt.forced_prefix:
            for ci, ch in enumerate(ps.choices):
                yield ChoiceEvent(pi, ci, ch.add(run_stages(ch.stages, ChoiceDelta(ci, ps.prompt.forced_prefix))))
    async for pi, out in _engine_outputs(gen, lease):
        t0 = time.perf_counter_ns()
        ps = gen.prompts[pi]
        _observe(gw, gen, ps, out)
        for c in out.outputs:
            if c.index >= len(ps.choices) or not (c.text_delta or c.token_ids_delta or c.finish_reason):
                continue
            ch = ps.choices[c.index]
            if ch.finish_reason is not None:    # ended by a stage (output moderation): nothing more
                continue
            d = ch.add(run_stages(ch.stages, ChoiceDelta.from_output(c)))
            await _abort_if_cut(gen, ps, d)
            gw.http_ns += time.perf_counter_ns() - t0
            yield ChoiceEvent(pi, c.index, d)
            t0 = time.perf_counter_ns()
        gw.http_ns += time.perf_counter_ns() - t0
        if gen.finished:
            return


async def run_to_end(gw: ServerState, gen: Generation, lease: Lease, receive: Receive) -> None:
    """Run a generation that does not stream to its end under its lease (released on the way out);
    raises ClientGone when the client hangs up first. The answer is then in `gen`."""
    async with lease:
        await until_disconnected(receive, _drain(run_generation(gw, gen, lease)))


async def _drain(events: AsyncIterator[ChoiceEvent]) -> None:
    async for _ in events:
        pass


def _observe(gw: ServerState, gen: Generation, ps: PromptState, out: RequestOutput) -> None:
    if out.prompt_logprobs is not None:
        ps.prompt_logprobs = out.prompt_logprobs
    if out.finished:
        ps.final = out   # one metrics observation per engine request that finished
        gw.metrics.observe_request(out.metrics, out.outputs[0].finish_reason if out.outputs else None,
                                   gateway_wait_s=gen.plan.timings.gateway_wait_s, model=gen.plan.model.name)


async def _abort_if_cut(gen: Generation, ps: PromptState, delta: ChoiceDelta) -> None:
    """When output moderation ended every choice of a prompt, abort its engine request now (its
    KV blocks are freed; the lease then sees a final output and does nothing more)."""
    if delta.finish_reason != "content_filter":
        return
    if all(ch.finish_reason is not None for ch in ps.choices) and ps.final is None:
        await gen.plan.model.abort(ps.request_id)


async def _engine_outputs(gen: Generation, lease: Lease) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from the engine, every prompt of the request merged into one stream.
    The key's salt scopes the prefix cache (routing/cache_scope.py); declared shared prompts stay unsalted."""
    plan, scope = gen.plan, lease.gw.cache_scope
    model, salt = plan.model, plan.cache_scope
    assert plan.params is not None
    draft = plan.candidate.draft if plan.candidate is not None else None
    min_lp = plan.candidate.min_logprob if plan.candidate is not None else None
    lease.streams = [model.generate(ps.prompt.token_ids, plan.params, ps.request_id, priority=plan.priority,
                                    cache_salt=salt.salt, prompt=ps.prompt.text,
                                    cache_salt_from=scope.shared_prefix(model.tokenizer, ps.prompt.token_ids,
                                                                        salt.client_salt),
                                    draft_token_ids=draft if i == 0 else None, draft_min_logprob=min_lp)
                     for i, ps in enumerate(gen.prompts)]
    lease.started = True
    if len(lease.streams) == 1:
        async for out in lease.streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which maps it to an error body
            await queue.put((i, e))
            return
        await queue.put((i, None))

    lease.tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(lease.streams)]
    pending = len(lease.tasks)
    while pending:
        i, item = await queue.get()
        if item is None:
            pending -= 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield i, item


async def _cached(gen: Generation) -> AsyncIterator[ChoiceEvent]:
    """A cached answer as a stream would bring it: a few pieces, then the stored finish reason."""
    assert gen.plan.cached is not None
    entry = gen.plan.cached.entry
    ch = gen.prompts[0].choices[0]
    words = entry.answer.split(" ")
    for i in range(0, len(words), CACHED_WORDS_PER_PIECE):
        text = " ".join(words[i:i + CACHED_WORDS_PER_PIECE]) + (" " if i + CACHED_WORDS_PER_PIECE < len(words) else "")
        yield ChoiceEvent(0, 0, ch.add(ChoiceDelta(0, text)))
    yield ChoiceEvent(0, 0, ch.add(ChoiceDelta(0, "", finish_reason=entry.finish_reason)))
