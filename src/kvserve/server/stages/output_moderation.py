"""Output moderation, the last stage of every choice (its input twin is gates/moderation.py).

Personal data is redacted as the text streams (safety.pii.StreamRedactor), and every
`check_every` tokens the last `window_chars` characters are checked while the engine keeps
decoding. On a flag the choice ends with `finish_reason: "content_filter"`, the rest of its text
is dropped, and the run (generation/run.py) aborts the engine request, which frees its KV blocks.
So a violating text is cut within one window of `check_every` tokens after it appears. Under
action `annotate` a flagged window is traced (`"action": "annotate"`) and the choice goes on.
Redaction is off by default (`pii_output`) and never runs on text that follows a grammar or
schema: a mask would break it (the trace records `pii_output` skipped instead).
"""

from __future__ import annotations

from typing import Any, Protocol

from kvserve.safety import pii
from kvserve.safety.moderator import ModerationConfig, Moderator, Verdict
from kvserve.server.stages.delta import ChoiceDelta, Stage


class VerdictSink(Protocol):
    """Where the stage reports its verdicts: gates/moderation.py's `ModerationService` (its metrics)."""

    def observe(self, stage: str, verdict: Verdict, action: str = "block") -> None: ...


class OutputModerationStage:
    """The last stage of a choice: redact personal data, check a window every N tokens, cut on a flag."""

    def __init__(self, moderator: Moderator | None, config: ModerationConfig, service: VerdictSink,
                 redact: bool | None = None, skipped_redaction: bool = False, support: str = ""):
        self.moderator = moderator
        self.config = config
        self.service = service
        redact = config.pii_output == "redact" if redact is None else redact
        self.redactor = pii.StreamRedactor() if redact else None
        self.window = ""
        self.unchecked = 0          # tokens since the last check
        self.checks: list[dict[str, Any]] = []
        if skipped_redaction:
            self.checks.append({"check": "pii_output", "action": "skipped", "reason": "structured output"})
        self.cut = False
        self.support = support      # the operator's support message, sent before the answer's first text

    def feed(self, delta: ChoiceDelta) -> ChoiceDelta:
        if self.cut:                # the choice already ended: nothing more goes out
            delta.text, delta.reasoning, delta.tool_calls = "", "", []
            delta.filtered = True
            return delta
        # the window holds the model's own text, before redaction, and the tool calls' names and arguments
        raw = delta.reasoning + delta.text + "".join(
            f" {tc['function'].get('name') or ''} {tc['function'].get('arguments') or ''}"
            for tc in delta.tool_calls if tc.get("function"))
        if self.redactor is not None:   # held-back text leaves an empty delta, sent as such (keeps the stream alive)
            delta.text = self.redactor.feed(delta.text) + (self.redactor.finish() if delta.done else "")
        if self.support and (delta.text or delta.done):
            delta.text, self.support = self.support.rstrip() + "\n\n" + delta.text, ""
            self.checks.append({"check": "support_message", "action": "added"})
        if self.moderator is None:
            return delta
        self.window = (self.window + raw)[-self.config.window_chars:]
        self.unchecked += max(1, len(delta.token_ids))
        if self.unchecked < self.config.check_every and not delta.done and not delta.tool_calls:
            return delta        # a tool call is checked before it goes out: a client may act on it at once
        self.unchecked = 0
        v = self.moderator.check(self.window, input=False)
        self.service.observe("output", v, self.config.action)
        if v.flagged and self.config.action == "annotate":
            self.checks.append({"check": "output", **v.summary(), "action": "annotate"})
            return delta
        self.checks.append({"check": "output", **v.summary()})
        if v.flagged:
            self.cut = True
            delta.text, delta.reasoning, delta.tool_calls, delta.calls = "", "", [], []
            delta.finish_reason, delta.stop_reason = "content_filter", None
            delta.filtered = True
        return delta


def trace_entries(input_checks: list[dict[str, Any]], stages: list[Stage]) -> list[dict[str, Any]]:
    """The moderation checks of a request: the input's, then those of a choice's output stage."""
    out = list(input_checks)
    for stage in stages:
        out += getattr(stage, "checks", [])
    return out
