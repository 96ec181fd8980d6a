"""OpenAI's Batch API over the server's generation path (the runner: api/batch_runner.py;
the batches and their lines: stores/batches.py).

    POST /v1/batches                  {"input_file_id", "endpoint", "completion_window": "24h", "metadata"}
    GET  /v1/batches                  ?limit= &after=
    GET  /v1/batches/{batch_id}
    POST /v1/batches/{batch_id}/cancel

A batch belongs to the key that created it, from one of that key's `batch` files; it answers
"validating" at once and the runner takes it from there (poll `GET /v1/batches/{id}`). Its
`output_file_id` and `error_file_id` are files of the same key (`GET /v1/files/{id}/content`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from kvserve.errors import InvalidRequest
from kvserve.server.api.files import BATCH_URLS, owner_of, page
from kvserve.server.protocol import _Strict, read_request

if TYPE_CHECKING:
    from kvserve.server.state import ServerState

WINDOWS = {"24h": 24 * 3600.0}


class BatchRequest(_Strict):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


def mount_batches(app: FastAPI, gw: ServerState) -> None:
    store, files = gw.backends.batches, gw.backends.files

    @app.post("/v1/batches")
    async def create(request: Request) -> dict:
        req = await read_request(request, BatchRequest, gw.settings)
        if req.endpoint not in BATCH_URLS:
            raise InvalidRequest(f"endpoint must be one of {', '.join(BATCH_URLS)}.", param="endpoint")
        if req.completion_window not in WINDOWS:
            raise InvalidRequest("completion_window must be \"24h\".", param="completion_window")
        owner = owner_of(request)
        file = await run_in_threadpool(files.get, owner, req.input_file_id)   # 404 for another key's file
        if file["purpose"] != "batch":
            raise InvalidRequest(f"File {req.input_file_id!r} was uploaded with purpose {file['purpose']!r}; a "
                                 "batch's input needs purpose \"batch\".", param="input_file_id")
        batch = await run_in_threadpool(store.create, owner, req.endpoint, req.input_file_id, req.completion_window,
                                        WINDOWS[req.completion_window], req.metadata)
        if gw.batch_runner is not None:
            gw.batch_runner.wake()
        return batch

    @app.get("/v1/batches")
    async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> dict:
        owner = owner_of(request)
        return await page(lambda n: store.list(owner, n, after), limit, cap=100)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve(request: Request, batch_id: str) -> dict:
        return await run_in_threadpool(store.get, owner_of(request), batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(request: Request, batch_id: str) -> dict:
        batch = await run_in_threadpool(store.cancel, owner_of(request), batch_id)
        if gw.batch_runner is not None:
            gw.batch_runner.wake()
        return batch
