"""What every backend module shares: the 503 for an unreachable store, and URL checks."""

from __future__ import annotations

import urllib.parse

from kvserve.errors import InvalidRequest, Overloaded


class StateStoreUnavailable(Overloaded, code="state_store_unavailable"):
    """Redis or PostgreSQL cannot be reached (HTTP 503 with Retry-After)."""


def redact(url: str) -> str:
    """A URL without its password, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc[0].split(":")[0] + ":***@" + netloc[1]))


def check_url(url: str, option: str, schemes: tuple[str, ...]) -> str:
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in schemes:
        raise InvalidRequest(f"{option} must be a {' or '.join(s + '://' for s in schemes)} URL, got "
                           f"{redact(url)!r}.", param=option)
    return url


DATABASE_SCHEMES = ("postgresql", "postgres")
REDIS_SCHEMES = ("redis", "rediss", "unix")
