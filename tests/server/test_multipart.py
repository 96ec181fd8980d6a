"""The streaming multipart reader of /v1/files (server/api/multipart.py): the same fields whatever
the chunking, quoted or bare names, the part cap, a field's cap, a form without its end."""

from __future__ import annotations

import pytest

from kvserve.errors import InvalidRequest
from kvserve.server.api.multipart import FormLimits, FormParser, parse_form

CT = "multipart/form-data; boundary=XyZ"
BODY = (b"preamble\r\n--XyZ\r\nContent-Disposition: form-data; name=purpose\r\n\r\nbatch\r\n"
        b"--XyZ\r\nContent-Disposition: form-data; name=\"skip\"\r\n\r\nignored\r\n"
        b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\nContent-Type: x\r\n\r\n"
        b"line one\r\n--XyYnot-a-delimiter\r\nline two\n\r\n--XyZ--\r\nepilogue")
LIMITS = FormLimits(fields={"file": 1000, "purpose": 64})


@pytest.mark.parametrize("chunk", [1, 2, 7, 64, len(BODY)])
def test_the_same_fields_whatever_the_chunking(chunk):
    p = FormParser(b"XyZ", LIMITS)
    for i in range(0, len(BODY), chunk):
        p.feed(BODY[i:i + chunk])
    assert p.close() == {"purpose": (None, b"batch"),
                         "file": ("a.jsonl", b"line one\r\n--XyYnot-a-delimiter\r\nline two\n")}


def test_caps_and_malformed_forms():
    with pytest.raises(InvalidRequest, match="more than 2 parts"):
        parse_form(BODY, CT, FormLimits(fields=LIMITS.fields, max_parts=2))
    with pytest.raises(InvalidRequest, match="larger than 5 bytes"):
        parse_form(BODY, CT, FormLimits(fields={"file": 5}))
    with pytest.raises(InvalidRequest, match="could not be read"):
        parse_form(BODY[:-20], CT, LIMITS)                       # no closing delimiter
    with pytest.raises(InvalidRequest, match="multipart/form-data"):
        parse_form(BODY, "application/json", LIMITS)
    with pytest.raises(InvalidRequest, match="headers are too long"):
        parse_form(b"--XyZ\r\n" + b"h" * 5000, CT, LIMITS)
