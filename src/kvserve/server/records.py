"""Typed per-request records: what the gateway knows about one HTTP request, passed explicitly.

* `RequestRecord`: made by the middleware (gates/auth.py) for every HTTP request (id, arrival
  time, caller) and written to the access log when the response is done. A generation handler attaches a
  `GenerationLog` to it: that is the only way a handler adds fields to the access log.

A generation's own state is in server/generation/: its plan (`GenerationPlan`), what it holds
(`Lease`) and what came back (`Generation`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvserve.server.stores.keys import ApiKey


@dataclass
class GenerationLog:
    """The access-log fields a generation request adds (in this order)."""

    model: str
    completion_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None
    request_status: int
    tool_calls: int | None = None         # written only when the first choice called tools
    error: str | None = None              # written only when set
    latency: dict[str, float | None] | None = None   # queue_ms, ttft_ms, tokens_per_s once a token came

    def fields(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("tool_calls", "error", "latency")}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.error:
            out["error"] = self.error
        out.update(self.latency or {})
        return out


@dataclass
class RequestRecord:
    """One HTTP request as the gateway saw it; the middleware makes it and writes the log line."""

    request_id: str
    t0: float                       # time.monotonic() at arrival
    method: str | None
    path: str
    key: ApiKey | None = None       # the caller's key; None when auth is off
    key_name: str | None = None
    key_tier: str = "paid"
    status: int = 500               # the HTTP status sent
    generation: GenerationLog | None = None
    moderation: dict[str, Any] | None = None   # the input check's verdict (server/gates/moderation.py)

    def access_log_line(self) -> str:
        line: dict[str, Any] = {"ts": round(time.time(), 3), "request_id": self.request_id,
                                "method": self.method, "path": self.path, "status": self.status,
                                "key_name": self.key_name}
        if self.generation is not None:
            line.update(self.generation.fields())
        if self.moderation is not None:
            line["moderation"] = self.moderation
        line["total_ms"] = round((time.monotonic() - self.t0) * 1000, 2)
        return json.dumps(line)
