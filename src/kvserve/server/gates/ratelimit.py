"""Token-bucket rate limits per key: one bucket for requests per minute, one for tokens per minute.

A bucket holds up to `capacity` tokens and refills at `capacity / 60` per second. A request takes
one from the request bucket when it arrives, and reserves `prompt tokens + max_tokens` from the
token bucket before it reaches the engine; when it finishes, the tokens it did not use go back.
Refusals say how long until the bucket would hold enough (`Retry-After`), and whether waiting can
help at all (`x-should-retry: false` when one request asks for more than the whole bucket).

The request bucket is taken by the gateway middleware for every authenticated route (generation,
/tokenize, the conversation API, ...); every response to a limited key carries the buckets' state
as OpenAI sends it: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (`headers`).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from kvserve.errors import RateLimitError


@dataclass
class TokenBucket:
    capacity: float
    refill_per_s: float
    tokens: float = field(default=-1.0)
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = self.capacity

    def _refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.refill_per_s)
        self.updated = now

    def wait_time(self, amount: float, now: float) -> float:
        """Seconds until `amount` is available (0 if it is now, inf if it never will be)."""
        self._refill(now)
        if amount > self.capacity:
            return math.inf
        if self.tokens >= amount:
            return 0.0
        return (amount - self.tokens) / self.refill_per_s

    def take(self, amount: float) -> None:
        self.tokens -= amount

    def give_back(self, amount: float, now: float) -> None:
        self._refill(now)
        self.tokens = min(self.capacity, self.tokens + amount)


class RateLimiter:
    """Buckets per key name, created on first use from the key's rpm/tpm, in this process's memory.

    The refusal messages and headers are built here from three bucket primitives (`_take`,
    `_give`, `_peek`); a shared store overrides only those (stores/redis_state.py keeps every
    bucket in Redis so all replicas draw from the same one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def _bucket(self, key_name: str, kind: str, per_minute: int) -> TokenBucket:
        bucket = self._buckets.get((key_name, kind))
        if bucket is None or bucket.capacity != per_minute:
            bucket = TokenBucket(capacity=float(per_minute), refill_per_s=per_minute / 60.0)
            self._buckets[(key_name, kind)] = bucket
        return bucket

    # --- the bucket primitives (kind is "rpm" or "tpm") ---

    def _take(self, key_name: str, kind: str, per_minute: int, amount: float) -> float:
        """Take `amount` if it is there and return 0; else take nothing and return the seconds
        until it would be (inf when it never fits)."""
        with self._lock:
            bucket = self._bucket(key_name, kind, per_minute)
            wait = bucket.wait_time(amount, time.monotonic())
            if wait == 0:
                bucket.take(amount)
            return wait

    def _give(self, key_name: str, kind: str, per_minute: int, amount: float) -> None:
        with self._lock:
            self._bucket(key_name, kind, per_minute).give_back(amount, time.monotonic())

    def _peek(self, key_name: str, kind: str, per_minute: int) -> float:
        """The tokens in the bucket now."""
        with self._lock:
            bucket = self._bucket(key_name, kind, per_minute)
            bucket._refill(time.monotonic())
            return bucket.tokens

    # --- what the gateway calls ---

    def acquire_request(self, key_name: str, rpm: int | None) -> None:
        if rpm is None:
            return
        wait = self._take(key_name, "rpm", rpm, 1)
        if wait > 0:
            raise RateLimitError(
                f"Rate limit reached for key {key_name!r}: {rpm} requests per minute. "
                f"Retry after {math.ceil(wait)} s, or ask for a higher --rpm.",
                retry_after=wait)

    def refuse_if_empty(self, name: str, per_minute: int, what: str) -> None:
        """429 when bucket `name` has no token left, taking none (a throttle checked before the
        attempt it throttles, so a refused attempt learns nothing)."""
        tokens = self._peek(name, "rpm", per_minute)
        if tokens < 1:
            wait = (1 - tokens) / (per_minute / 60.0)
            raise RateLimitError(f"{what}: at most {per_minute} a minute. Retry after {math.ceil(wait)} s.",
                                 retry_after=wait)

    def take_one(self, name: str, per_minute: int) -> None:
        """Take a token from bucket `name` if there is one (a failed attempt, counted)."""
        self._take(name, "rpm", per_minute, 1)

    def reserve_tokens(self, key_name: str, tpm: int | None, amount: int, param: str = "max_tokens") -> int:
        """Reserve `amount` tokens; returns what was reserved (0 when the key has no tpm limit).
        `param`: the field that sets the amount (an embeddings request's is its `input`)."""
        if tpm is None:
            return 0
        wait = self._take(key_name, "tpm", tpm, amount)
        if math.isinf(wait):
            what, fix = (("prompt + max_tokens", "Lower max_tokens or shorten the prompt") if param == "max_tokens"
                         else (param, f"Send a smaller {param}"))
            err = RateLimitError(
                f"This request needs {amount} tokens ({what}) but key {key_name!r} "
                f"is limited to {tpm} tokens per minute. {fix}.",
                param=param, retry_after=60.0)
            err.should_retry = False
            raise err
        if wait > 0:
            raise RateLimitError(
                f"Token rate limit reached for key {key_name!r}: {tpm} tokens per minute and this "
                f"request reserves {amount}. Retry after {math.ceil(wait)} s.", retry_after=wait)
        return amount

    def check_tokens(self, key_name: str, tpm: int, amount: int, param: str = "max_tokens") -> None:
        """429 when `amount` tokens could not be reserved now (more than the key's tpm: never; more
        than its bucket holds: retry later), taking none: the check a request passes before it may
        load a model, ahead of the reservation that needs the prompt's tokens."""
        if amount > tpm:
            err = RateLimitError(f"max_tokens asks for {amount} tokens but key {key_name!r} is limited to {tpm} "
                                 f"tokens per minute. Lower max_tokens.", param=param, retry_after=60.0)
            err.should_retry = False
            raise err
        tokens = self._peek(key_name, "tpm", tpm)
        if tokens < amount:
            wait = (amount - tokens) / (tpm / 60.0)
            raise RateLimitError(f"Token rate limit reached for key {key_name!r}: {tpm} tokens per minute and this "
                                 f"request reserves at least {amount}. Retry after {math.ceil(wait)} s.",
                                 retry_after=wait)

    def refund_tokens(self, key_name: str, tpm: int | None, amount: int) -> None:
        if tpm is None or amount <= 0:
            return
        self._give(key_name, "tpm", tpm, amount)

    def headers(self, key_name: str, rpm: int | None, tpm: int | None) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers for the key's buckets (none for an unlimited bucket)."""
        out: list[tuple[bytes, bytes]] = []
        for kind, per_minute in (("requests", rpm), ("tokens", tpm)):
            if per_minute is None:
                continue
            tokens = self._peek(key_name, "rpm" if kind == "requests" else "tpm", per_minute)
            remaining = max(0, math.floor(tokens))
            reset = (per_minute - tokens) / (per_minute / 60.0)
            out += [(f"x-ratelimit-limit-{kind}".encode(), str(per_minute).encode()),
                    (f"x-ratelimit-remaining-{kind}".encode(), str(remaining).encode()),
                    (f"x-ratelimit-reset-{kind}".encode(), _duration(reset).encode())]
        return out


def _duration(seconds: float) -> str:
    """A duration as OpenAI writes it in x-ratelimit-reset-*: "0s", "850ms", "1m30s"."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms" if seconds > 0 else "0s"
    minutes, secs = divmod(seconds, 60)
    return f"{int(minutes)}m{secs:.0f}s" if minutes else f"{secs:.3g}s"
