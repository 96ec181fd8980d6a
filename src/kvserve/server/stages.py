"""The per-request stage list: what the server does to each choice's output between the engine
client and the wire.

The engine client has already detokenized, applied stop strings and built logprobs; what comes
out of it for one choice in one step is a `ChoiceDelta`. Every stage has one method,
`feed(delta) -> delta`, called once per step and in order; the delta that carries a
`finish_reason` is the choice's last, so a stage that held text back releases it then. The run
(generation/run.py) feeds the stages; the API's renderer (server/api/) is the end of the line.

    engine client (detokenize, stops, logprobs) -> [reasoning] -> [tool calls] -> [moderation] -> render

A streamed and a non-streamed answer run through the same stages, so they agree. Adding a stage
(reasoning split, output moderation) is one line in `build_stages`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.outputs import CompletionOutput, PositionLogprobs
from kvserve.server.tools import ParsedCall, ToolCallParser, ToolPlan, stream_delta


@dataclass
class ChoiceDelta:
    """What one choice gained in one step."""

    index: int                                    # the choice's index within its prompt
    text: str = ""                                # content to send
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None              # the engine's reason; set on the choice's last delta
    stop_reason: int | str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)   # OpenAI `delta.tool_calls` entries
    calls: list[ParsedCall] = field(default_factory=list)            # every call, on the last delta
    filtered: bool = False   # a stage rewrote the text: send only what is left (no empty content)
    reasoning: str = ""      # reasoning text to send (`<think>` block; ReasoningStage)
    reasoning_tokens: int = 0   # tokens of the choice's reasoning so far
    drafted: list[bool] = field(default_factory=list)   # per token: an accepted draft (speculative decoding)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_output(cls, c: CompletionOutput) -> ChoiceDelta:
        return cls(c.index, c.text_delta, list(c.token_ids_delta), c.logprobs_delta, c.finish_reason,
                   c.stop_reason, drafted=list(c.drafted_delta))


class Stage(Protocol):
    def feed(self, delta: ChoiceDelta) -> ChoiceDelta:
        """Transform one step of one choice; the delta with a finish_reason is the last."""
        ...


class ToolCallStage:
    """`<tool_call>` blocks out of the text, into `tool_calls` (tools.ToolCallParser). Text that
    may be the start of a call is held back until it is known."""

    def __init__(self, plan: ToolPlan):
        self.parser: ToolCallParser = plan.parser()

    def feed(self, delta: ChoiceDelta) -> ChoiceDelta:
        events = self.parser.feed(delta.text)
        if delta.done:
            events += self.parser.finish()
            delta.calls = list(self.parser.calls)
        out = stream_delta(events)
        delta.text = out.get("content", "")
        delta.tool_calls = out.get("tool_calls", [])
        delta.filtered = True
        return delta


def build_stages(plan: ToolPlan | None, reasoning: bool = False, moderation=None) -> list[Stage]:
    """One choice's stage list, in order (chat answers get the reasoning split); `moderation` makes
    the output moderation stage (server/moderation.py), or is None."""
    stages: list[Stage] = []
    if reasoning:
        from kvserve.server.reasoning import ReasoningStage
        stages.append(ReasoningStage())
    if plan is not None and plan.active:
        stages.append(ToolCallStage(plan))
    if moderation is not None and (stage := moderation()) is not None:
        stages.append(stage)
    return stages


def run_stages(stages: list[Stage], delta: ChoiceDelta) -> ChoiceDelta:
    for stage in stages:
        delta = stage.feed(delta)
    return delta
