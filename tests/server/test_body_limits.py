"""gates/limits.read_json and protocol.read_request: one body read under one set of limits."""

import asyncio
from dataclasses import dataclass

import pytest
from starlette.requests import Request

from kvserve.errors import InvalidRequest
from kvserve.server.gates.limits import BodyTooLarge, read_json
from kvserve.server.protocol import TokenizeRequest, read_request


@dataclass
class Limits:
    max_body_bytes: int = 64
    body_timeout_s: float = 5.0
    max_json_depth: int = 2


def _request(body: bytes) -> Request:
    chunks = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return chunks.pop(0)

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


@pytest.mark.parametrize("off_loop", [False, True])
def test_read_json_applies_every_limit(off_loop):
    assert asyncio.run(read_json(_request(b'{"a": [1]}'), Limits(), off_loop=off_loop)) == {"a": [1]}
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_json(_request(b'{"a": "' + b"x" * 80 + b'"}'), Limits(), off_loop=off_loop))
    with pytest.raises(InvalidRequest, match="nested more than 2"):
        asyncio.run(read_json(_request(b'{"a": [[1]]}'), Limits(), off_loop=off_loop))


def test_read_request_validates_the_model():
    req = asyncio.run(read_request(_request(b'{"prompt": "hi"}'), TokenizeRequest, Limits()))
    assert req.prompt == "hi"
    with pytest.raises(InvalidRequest, match="Unrecognized request argument supplied: nope"):
        asyncio.run(read_request(_request(b'{"prompt": "hi", "nope": 1}'), TokenizeRequest, Limits()))
