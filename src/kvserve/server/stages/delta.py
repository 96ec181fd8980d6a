"""What flows through a choice's stage list: `ChoiceDelta` (one step of one choice) and the
`Stage` protocol every stage meets (stages/__init__.py runs them in order)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.outputs import CompletionOutput, PositionLogprobs
from kvserve.server.stages.tools import ParsedCall


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
