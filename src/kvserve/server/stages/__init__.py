"""The per-request stage list: what the server does to each choice's output between the engine
client and the wire.

The engine client has already detokenized, applied stop strings and built logprobs; what comes
out of it for one choice in one step is a `ChoiceDelta`. Every stage has one method,
`feed(delta) -> delta`, called once per step and in order; the delta that carries a
`finish_reason` is the choice's last, so a stage that held text back releases it then. The run
(generation/run.py) feeds the stages; the API's renderer (server/api/) is the end of the line.

    engine client (detokenize, stops, logprobs) -> [reasoning] -> [tool calls] -> [moderation] -> render

A streamed and a non-streamed answer run through the same stages, so they agree. Adding a stage
(reasoning split, output moderation) is a module here and one line in `build_stages`.

    delta.py              ChoiceDelta and the Stage protocol
    reasoning.py          the `<think>` split (ReasoningStage)
    tools.py              the tool plan (prompt, stop strings, grammar) and the `<tool_call>` parser
    output_moderation.py  PII redaction and the windowed check that ends a choice with content_filter
    structured.py         which request field a grammar comes from (the run's constraint, not a stage)
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.server.stages.delta import ChoiceDelta, Stage
from kvserve.server.stages.reasoning import ReasoningStage
from kvserve.server.stages.tools import ToolCallParser, ToolPlan, stream_delta

__all__ = ["ChoiceDelta", "Stage", "ToolCallStage", "build_stages", "run_stages"]


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


def build_stages(plan: ToolPlan | None, reasoning: bool = False,
                 moderation: Callable[[], Stage | None] | None = None) -> list[Stage]:
    """One choice's stage list, in order (chat answers get the reasoning split); `moderation` makes
    the output moderation stage (output_moderation.py; None when the policy has no output check)."""
    stages: list[Stage] = []
    if reasoning:
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
