"""Errors a user can cause. Each carries a message that says what to do.

The server maps them to OpenAI-shaped error bodies (`{"error": {"message", "type", "param",
"code"}}`) with the HTTP status in `status`; the CLI prints the message on one line and exits 1.
"""

from __future__ import annotations


class KVServeError(Exception):
    """Base class: something the user can fix."""

    status: int = 400
    type: str = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class RetryLater(KVServeError):
    """Base class: the same request can succeed later; `retry_after` seconds become the
    Retry-After header."""

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw):
        super().__init__(message, **kw)
        self.retry_after = retry_after


class InvalidRequest(KVServeError):
    """A request or parameter is malformed or out of range (HTTP 400)."""

    code = "invalid_value"


class ContextLengthExceeded(InvalidRequest):
    """Prompt (plus max tokens) does not fit in the model's context window (HTTP 400)."""

    code = "context_length_exceeded"


class ModelNotFound(KVServeError):
    """An unknown model name or a path that does not exist (HTTP 404)."""

    status = 404
    code = "model_not_found"


class ModelLoadError(KVServeError):
    """A model file exists but cannot be loaded: bad magic, truncated, unsupported (HTTP 500)."""

    status = 500
    type = "server_error"
    code = "model_load_error"


class AuthenticationError(KVServeError):
    """A missing, unknown or revoked API key, or a non-admin key on an admin route (HTTP 401)."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class RateLimitError(RetryLater):
    """A key's requests or tokens per minute are spent for now (HTTP 429)."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class Overloaded(RetryLater):
    """The server's waiting queue is full (HTTP 503)."""

    status = 503
    type = "server_error"
    code = "overloaded"


class ContentPolicyViolation(InvalidRequest):
    """Input moderation flagged the request (HTTP 400); it never reached the model."""

    code = "content_policy_violation"
