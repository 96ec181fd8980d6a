"""The limits every parsed request body passes, whatever the route: size, read time, JSON shape.

    read_body(request, limit, timeout)   the body, at most `limit` bytes (413), each chunk within
                                         `timeout` seconds (408): a client that stalls mid-body
                                         does not hold a connection and a task forever
    load_json(raw, max_depth)            a JSON object, nested at most `max_depth` deep, every
                                         string valid Unicode (a lone surrogate such as "\\ud800"
                                         is legal JSON but cannot be tokenized or stored): 400
    read_json(request, limits)           both, under one set of `BodyLimits` (the server's
                                         settings, or the conversation store's limits)

Generation, /tokenize, /detokenize and the conversation API all read their bodies through these
calls; the table of limits and the flag that changes each is in docs/api.md.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from kvserve.errors import InvalidRequest


class BodyTooLarge(InvalidRequest, status=413, code="request_too_large"):
    """The body is larger than the route allows (HTTP 413)."""


class BodyTimeout(InvalidRequest, status=408, code="request_timeout"):
    """A chunk of the body did not arrive in time (HTTP 408)."""


class BodyLimits(Protocol):
    """The limits one body is read under (ServerSettings and StoreLimits both carry them)."""

    max_body_bytes: int
    body_timeout_s: float
    max_json_depth: int


async def read_json(request: Request, limits: BodyLimits, *, off_loop: bool = False) -> Any:
    """read_body, then load_json, under `limits`; `off_loop` parses in a worker thread (a route
    whose bodies are often large: stored traces, whole conversations)."""
    raw = await read_body(request, limits.max_body_bytes, limits.body_timeout_s)
    if off_loop:
        return await run_in_threadpool(load_json, raw, limits.max_json_depth)
    return load_json(raw, limits.max_json_depth)


async def read_body(request: Request, limit: int, timeout: float | None = 30.0) -> bytes:
    """The raw body; BodyTooLarge past `limit` bytes, BodyTimeout when a chunk takes longer than
    `timeout` seconds to arrive."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"The request body is larger than {limit} bytes.", param="body")
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), timeout)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise BodyTimeout(f"The request body did not arrive within {timeout:g} s.", param="body") from None
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"The request body is larger than {limit} bytes.", param="body")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_shape(data: Any, max_depth: int) -> None:
    """Depth and Unicode of every value, iteratively (a deep document must not recurse here)."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, (dict, list)):
            if depth > max_depth:
                raise InvalidRequest(f"The request body is nested more than {max_depth} levels deep.",
                                     param=path or None)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                sub = f"{path}[{k}]" if isinstance(k, int) else (f"{path}.{k}" if path else str(k))
                if isinstance(k, str):
                    _check_text(k, sub)
                stack.append((v, depth + 1, sub))


def _check_text(s: str, path: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"Invalid value for {path or 'body'}: the string holds a lone UTF-16 "
                             "surrogate (such as \\ud800), which is not a character; send valid "
                             "Unicode.", param=path or None) from None


def load_json(raw: bytes, max_depth: int = 64) -> dict:
    """A JSON object from `raw`; InvalidRequest for bad JSON, non-objects, deep nesting or
    invalid Unicode."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidRequest(f"The request body is nested more than {max_depth} levels deep.") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"The request body is not valid JSON ({e}).") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    _check_shape(data, max_depth)
    return data
