"""A thinking request's state in the core: reasoning until `</think>`, then the answer.

A request with `SamplingParams.reasoning_budget` starts inside a `<think>` block (its prompt
opened it: the server appends `<think>\\n` to the generation prompt). The scheduler feeds it every
accepted token: when the text of the last few tokens shows `</think>` the reasoning is over; when
`budget` reasoning tokens were generated first, the end of the block (`end_ids`, the tokenized
`\\n</think>\\n\\n`) is appended as if sampled, and the model answers from there. A grammar
(structured output, tool calls) applies only to the answer: no bitmask and no matcher input
while reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
END_TEXT = "\n" + THINK_CLOSE + "\n\n"


@dataclass
class ReasoningState:
    budget: int
    end_ids: list[int]
    tail: list[int] = field(default_factory=list)   # the last few reasoning tokens (end detection)
    num_tokens: int = 0                             # reasoning tokens generated (forced ones included)
    done: bool = False

    def feed(self, tok: int, decode) -> list[int]:
        """One accepted token while reasoning; returns the tokens to force after it (the block's
        end once the budget is spent), and marks the reasoning done when it ended."""
        self.num_tokens += 1
        self.tail = (self.tail + [tok])[-8:]
        if THINK_CLOSE in decode(self.tail):
            self.done = True
            return []
        if self.num_tokens >= self.budget:
            self.done = True
            self.num_tokens += len(self.end_ids)
            return list(self.end_ids)
        return []
