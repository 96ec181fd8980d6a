"""The reasoning split: `<think>...</think>` out of the answer's content, into `reasoning_content`
(`message.reasoning_content`; streamed as `delta.reasoning_content`, as DeepSeek and vLLM do).

A chat answer that begins with `<think>` (leading whitespace aside) is reasoning up to
`</think>`; the whitespace after it is dropped and the rest is content. An answer that does not
begin with it is all content. A request that asks for reasoning (`reasoning_effort` or
`reasoning_budget`) has `<think>\\n` appended to its generation prompt, which goes through this
stage first, so the engine's output continues inside the block (and the engine closes it when
the budget is spent: kvserve.engine.reasoning_budget). Text that may be the start of a tag is held back
until it is known, so streamed and non-streamed answers agree.
"""

from __future__ import annotations

from kvserve.engine.reasoning_budget import THINK_CLOSE, THINK_OPEN
from kvserve.server.stages.delta import ChoiceDelta

# reasoning_effort -> reasoning tokens before </think> is forced
EFFORT_BUDGETS = {"low": 128, "medium": 512, "high": 2048}


def _partial(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """Incremental: feed(text) -> (reasoning, content); finish() -> the rest."""

    def __init__(self):
        self.state = "start"          # start | think | answer
        self.buf = ""
        self.num_tokens = 0           # tokens that arrived while reasoning (the trace counts them)
        self.said = False             # some reasoning text was emitted

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self.state, self.buf = "think", s[len(THINK_OPEN):].lstrip("\n")
                    continue
                if THINK_OPEN.startswith(s):      # still possibly the opening tag
                    return reasoning, content
                self.state = "answer"
            if self.state == "think":
                if not self.said:                 # the block's leading whitespace is neither
                    self.buf = self.buf.lstrip()
                i = self.buf.find(THINK_CLOSE)
                if i < 0:                         # hold back a partial tag and trailing whitespace
                    emit = self.buf[:len(self.buf) - _partial(self.buf, THINK_CLOSE)].rstrip()
                    reasoning += emit
                    self.buf = self.buf[len(emit):]
                    self.said = self.said or bool(emit)
                    return reasoning, content
                reasoning += self.buf[:i].rstrip()
                self.state, self.buf = "after", self.buf[i + len(THINK_CLOSE):]
            if self.state == "after":             # whitespace right after </think> is neither
                s = self.buf.lstrip()
                if not s:
                    self.buf = ""
                    return reasoning, content
                self.state, self.buf = "answer", s
            content += self.buf
            self.buf = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.state == "think":
            return rest.rstrip(), ""
        return "", rest if self.state != "after" else ""

    @property
    def reasoning(self) -> bool:
        return self.state == "think"


class ReasoningStage:
    """Stage: the choice's text split into reasoning and content (see ReasoningParser)."""

    def __init__(self):
        self.parser = ReasoningParser()

    def feed(self, delta: ChoiceDelta) -> ChoiceDelta:
        if self.parser.reasoning or self.parser.state == "start":
            self.parser.num_tokens += len(delta.token_ids)
        reasoning, content = self.parser.feed(delta.text)
        if delta.done:
            r2, c2 = self.parser.finish()
            reasoning, content = reasoning + r2, content + c2
        delta.reasoning, delta.text, delta.filtered = reasoning, content, True
        delta.reasoning_tokens = self.parser.num_tokens
        return delta
