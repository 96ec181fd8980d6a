"""The error classes' wire shape: status, type and code declared in the class line."""

from kvserve.errors import ContextLengthExceeded, InvalidRequest, KVServeError, Overloaded, RateLimitError


def test_class_keywords_set_status_type_and_code():
    class Gone(KVServeError, status=410, code="gone"):
        """A test error."""

    assert (Gone.status, Gone.type, Gone.code) == (410, "invalid_request_error", "gone")
    assert Gone("bye", param="id").to_dict() == {
        "error": {"message": "bye", "type": "invalid_request_error", "param": "id", "code": "gone"}}


def test_subclasses_inherit_what_they_do_not_name():
    assert (ContextLengthExceeded.status, ContextLengthExceeded.code) == (400, "context_length_exceeded")
    assert (Overloaded.status, Overloaded.type, Overloaded.code) == (503, "server_error", "overloaded")
    assert RateLimitError("slow down", retry_after=3).retry_after == 3
    assert InvalidRequest("x", code="other").code == "other" and InvalidRequest.code == "invalid_value"
