"""OpenAI's Files API, for the Batch API's input and output files (stores/files.py keeps them).

    POST   /v1/files                  multipart: `file` (JSONL) and `purpose` ("batch" | "user_data")
    GET    /v1/files                  ?purpose= &limit= &after= &order=
    GET    /v1/files/{file_id}
    GET    /v1/files/{file_id}/content
    DELETE /v1/files/{file_id}

A file belongs to the key that uploaded it (another key's id is a 404). The body is read under
the server's per-file cap (413 `file_too_large`), the key's quota is checked in the store (413
`storage_quota_exceeded`), and a `batch` file is checked line by line before it is stored (400
naming the line): each line a JSON object with `custom_id`, `method: "POST"`, a `url` the Batch
API serves and a `body` object, custom_ids unique, at most `MAX_BATCH_LINES` lines. The form is
parsed with the standard library's MIME parser (no multipart dependency).
"""

from __future__ import annotations

import email.parser
import email.policy
import json
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from kvserve.errors import InvalidRequest
from kvserve.server.gates.limits import read_body
from kvserve.server.stores.files import UPLOAD_PURPOSES, FileStore

if TYPE_CHECKING:
    from kvserve.server.state import ServerState

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_BATCH_LINES = 50_000
FORM_OVERHEAD = 64 << 10     # the multipart form's own bytes around the file


def owner_of(request: Request) -> str:
    """The store owner of a request: its key's name (or "anonymous" when auth is off)."""
    name = request.state.record.key_name
    return f"key:{name}" if name else "anonymous"


def page(rows: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """OpenAI's cursor page of `rows` (fetched with one more than `limit`, to know `has_more`)."""
    data = rows[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}


def parse_form(body: bytes, content_type: str) -> dict[str, tuple[str | None, bytes]]:
    """{field: (filename, bytes)} of a multipart/form-data body."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidRequest("Upload a file as multipart/form-data with the fields `file` and `purpose`.",
                             param="file")
    unreadable = InvalidRequest("The multipart body could not be read; send `file` and `purpose` fields.",
                                param="file")
    try:
        head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
        if not msg.is_multipart():
            raise unreadable
        out: dict[str, tuple[str | None, bytes]] = {}
        for part in msg.iter_parts():
            name = part.get_param("name", header="content-disposition")
            if name:
                out[str(name)] = (part.get_filename(), part.get_payload(decode=True) or b"")
    except (ValueError, TypeError, LookupError, UnicodeError):   # what a malformed form can make the parser raise
        raise unreadable from None
    return out


def check_batch_lines(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The (custom_id, request) of each line of a batch input file; 400 naming the first bad line."""
    out: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise InvalidRequest(f"Line {i} of the file is not valid JSON.", param="file") from None
        if not isinstance(obj, dict):
            raise InvalidRequest(f"Line {i} is not a JSON object.", param="file")
        custom_id, url, body = obj.get("custom_id"), obj.get("url"), obj.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            raise InvalidRequest(f"Line {i} has no `custom_id` string.", param="file")
        if custom_id in seen:
            raise InvalidRequest(f"Line {i} repeats custom_id {custom_id!r}; each line needs its own.", param="file")
        if obj.get("method", "POST") != "POST":
            raise InvalidRequest(f"Line {i}: `method` must be \"POST\".", param="file")
        if url not in BATCH_URLS:
            raise InvalidRequest(f"Line {i}: `url` must be one of {', '.join(BATCH_URLS)}.", param="file")
        if not isinstance(body, dict):
            raise InvalidRequest(f"Line {i}: `body` must be a JSON object (the request's body).", param="file")
        extra = set(obj) - {"custom_id", "method", "url", "body"}
        if extra:
            raise InvalidRequest(f"Line {i} has unknown fields: {', '.join(sorted(extra))}.", param="file")
        seen.add(custom_id)
        out.append((custom_id, obj))
        if len(out) > MAX_BATCH_LINES:
            raise InvalidRequest(f"A batch file holds at most {MAX_BATCH_LINES} requests.", param="file")
    if not out:
        raise InvalidRequest("The batch file holds no requests.", param="file")
    return out


def mount_files(app: FastAPI, gw: ServerState) -> None:
    store: FileStore = gw.backends.files

    @app.post("/v1/files")
    async def upload(request: Request) -> dict:
        raw = await read_body(request, store.limits.max_file_bytes + FORM_OVERHEAD, gw.settings.body_timeout_s)
        form = await run_in_threadpool(parse_form, raw, request.headers.get("content-type", ""))
        purpose = form.get("purpose", (None, b""))[1].decode("utf-8", "replace").strip()
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequest(f"`purpose` must be one of {', '.join(UPLOAD_PURPOSES)}.", param="purpose")
        if "file" not in form:
            raise InvalidRequest("The form has no `file` field.", param="file")
        filename, data = form["file"]
        store.check_size(len(data))
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest("The file is not UTF-8 text; upload JSONL.", param="file") from None
        if purpose == "batch":
            await run_in_threadpool(check_batch_lines, text)
        return await run_in_threadpool(store.put, owner_of(request), purpose, filename or "upload.jsonl", text)

    @app.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None, limit: int = 10_000,
                         after: str | None = None, order: str = "desc") -> dict:
        if order not in ("asc", "desc"):
            raise InvalidRequest("`order` must be asc or desc.", param="order")
        limit = max(1, min(limit, 10_000))
        return page(await run_in_threadpool(store.list, owner_of(request), purpose, limit + 1, after, order), limit)

    @app.get("/v1/files/{file_id}")
    async def retrieve(request: Request, file_id: str) -> dict:
        return await run_in_threadpool(store.get, owner_of(request), file_id)

    @app.get("/v1/files/{file_id}/content")
    async def content(request: Request, file_id: str) -> Response:
        text = await run_in_threadpool(store.content, owner_of(request), file_id)
        return Response(text.encode(), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete(request: Request, file_id: str) -> dict:
        await run_in_threadpool(store.delete, owner_of(request), file_id)
        return {"id": file_id, "object": "file", "deleted": True}
