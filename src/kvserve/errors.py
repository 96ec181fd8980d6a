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

    def __init_subclass__(cls, *, status: int | None = None, type: str | None = None, code: str | None = None,
                          **kw) -> None:
        """`class NotFound(KVServeError, status=404, code="not_found")`: a subclass names what it
        changes of the HTTP status, the error type and the code in its class line."""
        super().__init_subclass__(**kw)
        for name, value in (("status", status), ("type", type), ("code", code)):
            if value is not None:
                setattr(cls, name, value)

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


class InvalidRequest(KVServeError, code="invalid_value"):
    """A request or parameter is malformed or out of range (HTTP 400)."""


class ContextLengthExceeded(InvalidRequest, code="context_length_exceeded"):
    """Prompt (plus max tokens) does not fit in the model's context window (HTTP 400)."""


class ModelNotFound(KVServeError, status=404, code="model_not_found"):
    """An unknown model name or a path that does not exist (HTTP 404)."""


class ModelLoadError(KVServeError, status=500, type="server_error", code="model_load_error"):
    """A model file exists but cannot be loaded: bad magic, truncated, unsupported (HTTP 500)."""


class AuthenticationError(KVServeError, status=401, type="authentication_error", code="invalid_api_key"):
    """A missing, unknown or revoked API key, or a non-admin key on an admin route (HTTP 401)."""


class RateLimitError(RetryLater, status=429, type="rate_limit_error", code="rate_limit_exceeded"):
    """A key's requests or tokens per minute are spent for now (HTTP 429)."""


class Overloaded(RetryLater, status=503, type="server_error", code="overloaded"):
    """The server's waiting queue is full (HTTP 503)."""


class ContentPolicyViolation(InvalidRequest, code="content_policy_violation"):
    """Input moderation flagged the request (HTTP 400); it never reached the model."""
