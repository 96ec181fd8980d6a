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
parsed as it arrives (api/multipart.py: at most a few parts, each field capped), uploads at once
are capped per key and per server (429 with Retry-After and `x-ratelimit-*-uploads`), and a batch
file's lines are checked one at a time (split on "\n" only, each under the interactive route's
body checks and at most `MAX_LINE_BYTES`), never all held at once. `expires_after` (OpenAI's
`anchor`/`seconds`) sets when an upload expires; expired files are gone at once and purged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from kvserve.errors import InvalidRequest, RetryLater
from kvserve.server.api.multipart import FormLimits, read_form
from kvserve.server.gates.limits import load_json
from kvserve.server.stores.files import UPLOAD_PURPOSES, FileStore

if TYPE_CHECKING:
    from kvserve.server.state import ServerState

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_BATCH_LINES = 50_000
FORM_OVERHEAD = 64 << 10     # the multipart form's own bytes around the file
MAX_LINE_BYTES = 1 << 20     # one line of a batch file (the interactive body cap's default)
MAX_CUSTOM_ID = 512
UPLOADS_PER_KEY, UPLOADS_TOTAL = 2, 8
EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 30 * 86400     # OpenAI's bounds on expires_after.seconds


class UploadsBusy(RetryLater, status=429, type="rate_limit_error", code="too_many_uploads"):
    """Too many uploads in progress for this key or this server (HTTP 429)."""

    def __init__(self, message: str, *, headers: dict[str, str], **kw):
        super().__init__(message, **kw)
        self.headers = headers


def owner_of(request: Request) -> str:
    """The store owner of a request: its key's name (or "anonymous" when auth is off)."""
    name = request.state.record.key_name
    return f"key:{name}" if name else "anonymous"


async def page(fetch: Callable[[int], list[dict[str, Any]]], limit: int, cap: int) -> dict[str, Any]:
    """OpenAI's cursor page for a list route: `limit` clamped to 1..`cap`, and `fetch(n)` (the
    store's list, run off the event loop) asked for one row more than that, to know `has_more`."""
    limit = max(1, min(limit, cap))
    rows = await run_in_threadpool(fetch, limit + 1)
    data = rows[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}


def iter_lines(text: str) -> Iterator[tuple[int, str]]:
    """(number, line) of JSONL split on "\n" only: U+2028, U+0085 and the other characters
    `str.splitlines` breaks on are valid inside a JSON string. A trailing "\r" is JSON whitespace."""
    start, n, size = 0, 1, len(text)
    while start < size:
        end = text.find("\n", start)
        end = size if end < 0 else end
        yield n, text[start:end]
        start, n = end + 1, n + 1


def batch_lines(text: str, max_line_bytes: int = MAX_LINE_BYTES, max_depth: int = 64,
                ) -> Iterator[tuple[int, str, str, dict[str, Any]]]:
    """(line number, custom_id, url, body) of each request of a batch input file, checked as it
    goes (one parsed line held at a time, each line through the interactive body checks of
    gates/limits.py: depth, lone surrogates); 400 naming the first bad line."""
    seen: set[str] = set()
    count = 0
    for i, line in iter_lines(text):
        if not line.strip():
            continue
        if len(line) > max_line_bytes or len(line.encode()) > max_line_bytes:
            raise InvalidRequest(f"Line {i} is longer than {max_line_bytes} bytes, the cap of one request's body.",
                                 param="file")
        try:
            obj = load_json(line.encode(), max_depth + 1)
        except InvalidRequest as e:
            raise InvalidRequest(f"Line {i}: {e.message}", param="file") from None
        custom_id, url, body = obj.get("custom_id"), obj.get("url"), obj.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            raise InvalidRequest(f"Line {i} has no `custom_id` string.", param="file")
        if len(custom_id) > MAX_CUSTOM_ID:
            raise InvalidRequest(f"Line {i}: `custom_id` is longer than {MAX_CUSTOM_ID} characters.", param="file")
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
        count += 1
        if count > MAX_BATCH_LINES:
            raise InvalidRequest(f"A batch file holds at most {MAX_BATCH_LINES} requests.", param="file")
        yield i, custom_id, url, body
    if not count:
        raise InvalidRequest("The batch file holds no requests.", param="file")


def check_batch_lines(text: str, max_line_bytes: int = MAX_LINE_BYTES, max_depth: int = 64) -> int:
    """How many requests a batch input file holds; 400 naming the first bad line (nothing kept)."""
    return sum(1 for _ in batch_lines(text, max_line_bytes, max_depth))


def expiry_of(form: dict[str, tuple[str | None, bytes]]) -> float | None:
    """`expires_after[seconds]` (with `expires_after[anchor]` "created_at"), as OpenAI takes it."""
    anchor = form.get("expires_after[anchor]", (None, b""))[1].decode("utf-8", "replace").strip()
    raw = form.get("expires_after[seconds]", (None, b""))[1].decode("utf-8", "replace").strip()
    if not anchor and not raw:
        return None
    if anchor != "created_at" or not raw.isdigit() or not EXPIRES_MIN_S <= int(raw) <= EXPIRES_MAX_S:
        raise InvalidRequest(f"`expires_after` needs anchor \"created_at\" and seconds between {EXPIRES_MIN_S} and "
                             f"{EXPIRES_MAX_S}.", param="expires_after")
    return float(raw)


class UploadSlots:
    """Uploads parsed at once, per key and in all (429 past either, with Retry-After)."""

    def __init__(self, per_key: int = UPLOADS_PER_KEY, total: int = UPLOADS_TOTAL):
        self.per_key, self.total = per_key, total
        self.by_key: dict[str, int] = {}
        self.n = 0

    @contextlib.contextmanager
    def take(self, owner: str) -> Iterator[None]:
        if self.n >= self.total or self.by_key.get(owner, 0) >= self.per_key:
            mine = self.by_key.get(owner, 0) >= self.per_key
            raise UploadsBusy(f"{'This key already has' if mine else 'The server already has'} "
                              f"{self.per_key if mine else self.total} uploads in progress; retry when one ends.",
                              retry_after=1.0, headers={"x-ratelimit-limit-uploads": str(
                                  self.per_key if mine else self.total), "x-ratelimit-remaining-uploads": "0"})
        self.n += 1
        self.by_key[owner] = self.by_key.get(owner, 0) + 1
        try:
            yield
        finally:
            self.n -= 1
            self.by_key[owner] -= 1
            if not self.by_key[owner]:
                del self.by_key[owner]


def mount_files(app: FastAPI, gw: ServerState) -> None:
    store: FileStore = gw.backends.files

    slots = UploadSlots()
    line_cap = max(MAX_LINE_BYTES, gw.settings.max_body_bytes)

    @app.post("/v1/files")
    async def upload(request: Request) -> dict:
        owner = owner_of(request)
        limits = FormLimits(fields={"file": store.limits.max_file_bytes, "purpose": 64, "expires_after[anchor]": 64,
                                    "expires_after[seconds]": 64}, timeout_s=gw.settings.body_timeout_s,
                            too_large=lambda name, n: store.size_error(n) if name == "file" else
                            InvalidRequest(f"The form field `{name}` is too long.", param=name))
        with slots.take(owner):
            form = await read_form(request, limits, store.limits.max_file_bytes + FORM_OVERHEAD)
            purpose = form.get("purpose", (None, b""))[1].decode("utf-8", "replace").strip()
            if purpose not in UPLOAD_PURPOSES:
                raise InvalidRequest(f"`purpose` must be one of {', '.join(UPLOAD_PURPOSES)}.", param="purpose")
            if "file" not in form:
                raise InvalidRequest("The form has no `file` field.", param="file")
            expires_s = expiry_of(form)
            filename, data = form.pop("file")
            store.check_size(len(data))
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidRequest("The file is not UTF-8 text; upload JSONL.", param="file") from None
            del data
            if purpose == "batch":
                await run_in_threadpool(check_batch_lines, text, line_cap, gw.settings.max_json_depth)
            return await run_in_threadpool(lambda: store.put(owner, purpose, filename or "upload.jsonl", text,
                                                             expires_s=expires_s))

    @app.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None, limit: int = 10_000,
                         after: str | None = None, order: str = "desc") -> dict:
        if order not in ("asc", "desc"):
            raise InvalidRequest("`order` must be asc or desc.", param="order")
        owner = owner_of(request)
        return await page(lambda n: store.list(owner, purpose, n, after, order), limit, cap=10_000)

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
