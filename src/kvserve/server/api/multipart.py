"""A streaming multipart/form-data reader for /v1/files: the body is parsed chunk by chunk as it
arrives, never held whole, with a cap on the parts, on each part's headers and on each field.

    form = await read_form(request, limits)     # {name: (filename, bytes)} of the known fields

The work is linear in the body and bounded before the body ends: a form of more than
`max_parts` parts is refused (400) at the first part past the cap, so a body of a million
empty parts costs one scan of its first few hundred bytes, not a parse of each part. Only the
fields in `fields` are kept; a field larger than its cap is a 413 as soon as it passes it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from kvserve.errors import InvalidRequest
from kvserve.server.gates.limits import BodyTimeout, BodyTooLarge

_BOUNDARY = re.compile(r'boundary="?([^";]{1,200})"?', re.IGNORECASE)
_DISPOSITION = re.compile(rb'content-disposition:[^\r\n]*', re.IGNORECASE)
_PARAM = re.compile(rb';\s*(name|filename)=(?:"([^"\r\n]*)"|([^";\s]+))', re.IGNORECASE)


@dataclass
class FormLimits:
    """What one upload's form may hold."""

    fields: dict[str, int] = field(default_factory=dict)   # field name → its cap in bytes
    max_parts: int = 8
    max_header_bytes: int = 4096
    timeout_s: float | None = 30.0
    too_large: Callable[[str, int], Exception] | None = None   # the error for a field past its cap


def _unreadable() -> InvalidRequest:
    return InvalidRequest("The multipart body could not be read; send `file` and `purpose` fields.", param="file")


class FormParser:
    """The state machine over the chunks; `feed` each chunk, then `close`."""

    def __init__(self, boundary: bytes, limits: FormLimits):
        self.limits = limits
        self.delim = b"\r\n--" + boundary
        self.buf = bytearray(b"\r\n")       # the first delimiter has no CRLF before it
        self.state = "preamble"             # preamble → headers → body → (headers | done)
        self.parts = 0
        self.name: str | None = None
        self.filename: str | None = None
        self.cur = bytearray()
        self.out: dict[str, tuple[str | None, bytes]] = {}

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        while self._step():
            pass

    def _step(self) -> bool:
        buf, delim = self.buf, self.delim
        if self.state == "done":
            self.buf.clear()
            return False
        if self.state in ("preamble", "body"):
            at = buf.find(delim)
            if at < 0:   # keep what could be the start of a delimiter, take the rest
                keep = len(delim) + 1
                if len(buf) > keep:
                    self._take(buf[:-keep])
                    del buf[:-keep]
                return False
            if len(buf) < at + len(delim) + 2:
                return False
            self._take(buf[:at])
            tail = bytes(buf[at + len(delim):at + len(delim) + 2])
            del buf[:at + len(delim) + 2]
            self._end_part()
            if tail == b"--":
                self.state = "done"
                return False
            if tail != b"\r\n":
                raise _unreadable()
            self.parts += 1
            if self.parts > self.limits.max_parts:
                raise InvalidRequest(f"The form has more than {self.limits.max_parts} parts; an upload sends "
                                     "`file`, `purpose` and optionally `expires_after`.", param="file")
            self.state = "headers"
            return True
        end = buf.find(b"\r\n\r\n")   # headers
        if end < 0:
            if len(buf) > self.limits.max_header_bytes:
                raise InvalidRequest("A part's headers are too long.", param="file")
            return False
        if end > self.limits.max_header_bytes:
            raise InvalidRequest("A part's headers are too long.", param="file")
        head = bytes(buf[:end])
        del buf[:end + 4]
        disp = _DISPOSITION.search(head)
        params = {k.lower(): q or bare for k, q, bare in _PARAM.findall(disp[0])} if disp else {}
        name = params.get(b"name")
        self.name = name.decode("utf-8", "replace") if name is not None else None
        fn = params.get(b"filename")
        self.filename = fn.decode("utf-8", "replace") if fn is not None else None
        self.cur = bytearray()
        self.state = "body"
        return True

    def _take(self, data: bytes | bytearray) -> None:
        if self.state != "body" or self.name not in self.limits.fields or not data:
            return
        cap = self.limits.fields[self.name]
        if len(self.cur) + len(data) > cap:
            if self.limits.too_large is not None:
                raise self.limits.too_large(self.name, len(self.cur) + len(data))
            raise BodyTooLarge(f"The form field `{self.name}` is larger than {cap} bytes.", param=self.name)
        self.cur += data

    def _end_part(self) -> None:
        if self.state == "body" and self.name in self.limits.fields:
            if self.name in self.out:
                raise InvalidRequest(f"The form sends `{self.name}` twice.", param=self.name)
            self.out[self.name] = (self.filename, bytes(self.cur))
        self.cur = bytearray()
        self.name = None

    def close(self) -> dict[str, tuple[str | None, bytes]]:
        if self.state != "done":
            raise _unreadable()
        return self.out


def boundary_of(content_type: str) -> bytes:
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidRequest("Upload a file as multipart/form-data with the fields `file` and `purpose`.",
                             param="file")
    m = _BOUNDARY.search(content_type)
    if m is None:
        raise _unreadable()
    return m[1].strip().encode("latin-1", "replace")


async def read_form(request: Request, limits: FormLimits, max_body: int) -> dict[str, tuple[str | None, bytes]]:
    """The known fields of the request's multipart form, parsed as the body arrives."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        raise BodyTooLarge(f"The request body is larger than {max_body} bytes.", param="body")
    parser = FormParser(boundary_of(request.headers.get("content-type", "")), limits)
    stream, size = request.stream().__aiter__(), 0
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), limits.timeout_s)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise BodyTimeout(f"The request body did not arrive within {limits.timeout_s:g} s.",
                              param="body") from None
        size += len(chunk)
        if size > max_body:
            raise BodyTooLarge(f"The request body is larger than {max_body} bytes.", param="body")
        parser.feed(chunk)
    return parser.close()


def parse_form(body: bytes, content_type: str, limits: FormLimits) -> dict[str, tuple[str | None, bytes]]:
    """The same over a whole body (tests, tools)."""
    parser = FormParser(boundary_of(content_type), limits)
    parser.feed(body)
    return parser.close()
