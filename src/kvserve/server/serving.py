"""One generation request, from validated body to response: the part of the gateway that talks to
the engine.

Order of the gates, cheapest first: parse + caps (400) → model (404 / 503 while loading) →
request bucket (429) → ladder (503, or a max_tokens cap) → template + tokenize in a thread →
context window (400) → SamplingParams (400) → token bucket reservation (429) → admission slot
(waits; 503 if the queue is full). Everything taken is given back in `finish()`, which runs
exactly once whether the response completed, failed, or the client hung up.

A request with several prompts (/v1/completions with a list) runs them concurrently as separate
engine requests under one admission slot; `_Run` merges their outputs into one stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from kvserve.outputs import PositionLogprobs, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.admission import TIER_PRIORITY, Ticket
from kvserve.server.context import Prompt, token_texts
from kvserve.server.formatting import build_trace
from kvserve.server.tools import ToolPlan

logger = logging.getLogger("kvserve.server")


class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


async def until_disconnected(receive, aw):
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


def engine_priority(tier: str, requested: int) -> int:
    """Lower runs first: the tier decides, the request's own `priority` orders within a tier."""
    return TIER_PRIORITY.get(tier, 1) * 1_000_000 + max(-100_000, min(100_000, requested))


@dataclass
class Choice:
    """What has been generated for one choice so far (accumulated from the deltas)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    tool_calls: list = field(default_factory=list)   # parsed tool calls (see tools.py)


@dataclass
class PromptState:
    prompt: Prompt
    request_id: str
    choices: list[Choice]
    final: RequestOutput | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def metrics(self) -> RequestMetrics | None:
        return self.final.metrics if self.final is not None else None

    @property
    def num_cached(self) -> int:
        if self.final is None:
            return 0
        return self.final.num_cached_tokens or (self.final.metrics.num_cached_tokens if self.final.metrics else 0)


class Job:
    """Everything one HTTP generation request holds, and the bookkeeping to release it."""

    def __init__(self, server, request, *, kind: str, prompts: list[Prompt], params: SamplingParams,
                 priority: int, cache_salt: str | None, marks: dict, trace: bool, model_name: str,
                 tools: ToolPlan | None = None):
        self.server = server
        self.state = request.state
        self.kind = kind
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.params = params
        self.priority = priority
        self.cache_salt = cache_salt
        self.marks = marks
        self.trace = trace
        self.model_name = model_name
        self.tools = tools if tools is not None and tools.active else None   # parse tool calls?
        self.prompts = [PromptState(p, f"{self.id}-{i}", [Choice() for _ in range(params.n)])
                        for i, p in enumerate(prompts)]
        self.ticket: Ticket | None = None
        self.reserved_tokens = 0
        self.tasks: list[asyncio.Task] = []
        self._finished = False

    # ---- running ---------------------------------------------------------------------------
    async def _pump(self, i: int, ps: PromptState, queue: asyncio.Queue) -> None:
        engine = self.server.engine
        try:
            async for out in engine.generate(ps.prompt.token_ids, self.params, ps.request_id,
                                             priority=self.priority, cache_salt=self.cache_salt,
                                             prompt=ps.prompt.text):
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which maps it to an error body
            await queue.put((i, e))
            return
        await queue.put((i, None))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Merged engine outputs of all prompts, with choices accumulated as they arrive."""
        queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._pump(i, ps, queue)) for i, ps in enumerate(self.prompts)]
        pending = len(self.tasks)
        while pending:
            i, item = await queue.get()
            if item is None:
                pending -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            ps = self.prompts[i]
            for c in item.outputs:
                ch = ps.choices[c.index] if c.index < len(ps.choices) else None
                if ch is None:
                    continue
                ch.text += c.text_delta
                ch.token_ids.extend(c.token_ids_delta)
                if c.logprobs_delta:
                    ch.logprobs.extend(c.logprobs_delta)
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
            if item.prompt_logprobs is not None:
                ps.prompt_logprobs = item.prompt_logprobs
            if item.finished:
                ps.final = item
                # Exactly one observation per engine request that finished normally.
                self.server.metrics.observe_request(
                    item.metrics, item.outputs[0].finish_reason if item.outputs else None,
                    gateway_wait_s=self.marks.get("gateway_wait_s", 0.0))
            yield i, item

    # ---- results ---------------------------------------------------------------------------
    def usage_counts(self) -> tuple[int, int, int]:
        prompt = sum(len(ps.prompt.token_ids) for ps in self.prompts)
        completion = sum(len(ch.token_ids) for ps in self.prompts for ch in ps.choices)
        cached = sum(ps.num_cached for ps in self.prompts)
        return prompt, completion, cached

    def trace_for(self, ps: PromptState) -> dict:
        engine = self.server.engine
        m = ps.metrics
        ch = ps.choices[0]
        return build_trace(
            request_id=self.id, prompt_text=ps.prompt.text, prompt_ids=ps.prompt.token_ids,
            num_cached=ps.num_cached, prompt_token_texts=self.marks.get("prompt_token_texts", []),
            timings=self.marks, metrics=m, output_ids=ch.token_ids, output_positions=ch.logprobs,
            decode=self.decode, kv_blocks=m.num_kv_blocks if m else 0, block_size=engine.block_size)

    def decode(self, token_id: int) -> str:
        cache = self.marks.setdefault("_decoded", {})
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = token_texts(self.server.engine.tokenizer, [token_id])[0]
        return text

    # ---- cleanup ---------------------------------------------------------------------------
    async def finish(self, status: int, error: str | None = None) -> None:
        """Stop engine work, release the slot, refund tokens, write ledger + access-log fields. Once."""
        if self._finished:
            return
        self._finished = True
        with anyio.CancelScope(shield=True):
            for t in self.tasks:
                t.cancel()
            if self.tasks:
                await asyncio.gather(*self.tasks, return_exceptions=True)
            engine = self.server.engine
            for ps in self.prompts:
                if ps.final is None and self.tasks:
                    with contextlib.suppress(Exception):  # already gone is fine
                        await engine.abort(ps.request_id)
            if self.ticket is not None:
                self.ticket.release()
            prompt, completion, cached = self.usage_counts()
            key = self.state.key
            if self.reserved_tokens:
                used = prompt + completion
                self.server.limiter.refund_tokens(self.state.key_name, key.tpm if key else None,
                                                  self.reserved_tokens - used)
            if self.tasks:
                try:
                    await asyncio.to_thread(self.server.keystore.record_usage, self.state.key_name,
                                            prompt, completion, cached)
                except Exception:
                    logger.exception("usage ledger write failed")
        self._fill_log(status, error, prompt, completion, cached)

    def _fill_log(self, status: int, error: str | None, prompt: int, completion: int, cached: int) -> None:
        log = self.state.log
        ps = self.prompts[0]
        m = ps.metrics
        first = ps.choices[0]
        log.update(model=self.model_name, completion_id=self.id, prompt_tokens=prompt,
                   completion_tokens=completion, cached_tokens=cached,
                   finish_reason="tool_calls" if first.tool_calls else first.finish_reason,
                   request_status=status)
        if first.tool_calls:
            log["tool_calls"] = len(first.tool_calls)
        if error:
            log["error"] = error
        if m is not None and m.first_token_time is not None:
            sched = m.first_scheduled_time or m.arrival_time
            log["queue_ms"] = round((self.marks.get("gateway_wait_s", 0.0) + sched - m.arrival_time) * 1000, 2)
            log["ttft_ms"] = round((m.first_token_time - self.marks["t0"]) * 1000, 2)
            end = m.finished_time or m.last_token_time or m.first_token_time
            n_out = len(ps.choices[0].token_ids)
            log["tokens_per_s"] = round(n_out / (end - m.first_token_time), 2) \
                if end > m.first_token_time else None


def sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"
