"""Each API's error body, chosen by the path it was asked on: the one place where an error
(a `kvserve.errors` exception, an unknown route, a crash) leaves in the shape its client parses.

    OpenAI (every other route)  {"error": {"message", "type", "param", "code"}}, the status as is
    Anthropic (/v1/messages*)   {"type": "error", "error": {"type", "message"}}, Anthropic's types;
                                503 (overloaded, still loading) becomes Anthropic's 529
    Ollama (/api/*)             {"error": "message"}, the status as is

The gateway (gates/auth.py: 401, 429, 503 before any route) and the app's exception handlers
(app.py) both answer through `shape_error`, so a route never formats an error itself.
"""

from __future__ import annotations

from typing import Any

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                   429: "rate_limit_error", 529: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
OLLAMA_PREFIX = "/api/"


def api_of(path: str) -> str:
    """"anthropic", "ollama" or "openai": whose error shape a response on `path` takes."""
    if path in ANTHROPIC_PATHS:
        return "anthropic"
    if path.startswith(OLLAMA_PREFIX):
        return "ollama"
    return "openai"


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status (already mapped: 529 for overloaded)."""
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def shape_error(path: str, status: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(status, body) of an OpenAI-shaped error `body` with `status`, as the API of `path` sends it."""
    api = api_of(path)
    if api == "openai":
        return status, body
    message = str((body.get("error") or {}).get("message") or "error")
    if api == "ollama":
        return status, {"error": message}
    status = 529 if status == 503 else status
    return status, anthropic_error(status, message)
