"""The web chat page: `/` (index.html), `/static/*` and the saved-conversation API.

    GET    /v1/kvserve/conversations                 list the caller's conversations (newest first)
    POST   /v1/kvserve/conversations                 create {title?, model?, settings?, messages?}
    GET    /v1/kvserve/conversations/{id}            one conversation with its messages (and traces)
    PATCH  /v1/kvserve/conversations/{id}            rename / change {title?, model?, settings?}
    DELETE /v1/kvserve/conversations/{id}
    POST   /v1/kvserve/conversations/{id}/messages   {messages: [{role, content, trace?, meta?}], start?}
                                                     writes at position `start` (default: append),
                                                     replacing every message from there on; answers
                                                     with what was written (ids, positions), not the
                                                     whole conversation

Bodies go through the same limits as every route (limits.py: size cap, read timeout, JSON depth,
valid Unicode; parsed off the event loop), each owner has a storage quota (stores/conversations.py), and
the key's request bucket is taken by the middleware like anywhere else.

The page and its assets are public; the conversation API sits behind the server's auth
middleware, which sets `request.state.key_name`. Conversations belong to that key name, or,
when auth is off, to the browser id the page sends in the `X-KVServe-Client` header.
"""

from __future__ import annotations

import pathlib
import re

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from kvserve.errors import InvalidRequest, KVServeError
from kvserve.server.gates.limits import read_json
from kvserve.server.stores.conversations import ConversationStore, StoreLimits

STATIC_DIR = pathlib.Path(__file__).parents[1] / "static"   # server/static/ (package data)
CLIENT_HEADER = "X-KVServe-Client"
_CLIENT_ID = re.compile(r"^[A-Za-z0-9_-]{8,64}$")

# The page renders untrusted model output; this policy is the second line of defence after the
# renderer's escaping: no inline script, no foreign origins, no plugins, no framing.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
                           "frame-ancestors 'none'")
_PAGE_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                 "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def owner_of(request: Request) -> str:
    """The owner string conversations are scoped by: the API key name, else the browser id."""
    key_name = getattr(request.state, "key_name", None)
    if key_name:
        return f"key:{key_name}"
    client = request.headers.get(CLIENT_HEADER, "")
    if not _CLIENT_ID.match(client):
        raise InvalidRequest(f"Send a header {CLIENT_HEADER} with a random id of 8-64 letters, digits, "
                             "'-' or '_' (the web page does this), or use an API key.", param=CLIENT_HEADER)
    return f"client:{client}"


def conversations_router(store: ConversationStore) -> APIRouter:
    router = APIRouter(prefix="/v1/kvserve/conversations")
    lim = store.limits

    async def _json_body(request: Request) -> dict:
        return await read_json(request, lim, off_loop=True)

    @router.get("")
    async def list_conversations(request: Request) -> dict:
        owner = owner_of(request)
        return {"object": "list", "data": await run_in_threadpool(store.list, owner)}

    @router.post("")
    async def create_conversation(request: Request) -> dict:
        owner = owner_of(request)
        body = await _json_body(request)
        conv = await run_in_threadpool(store.create, owner, body.get("title") or "New chat",
                                       body.get("model"), body.get("settings"))
        if body.get("messages"):
            written = await run_in_threadpool(store.put_messages, owner, conv["id"], body["messages"])
            return {**conv, "messages": written["messages"]}
        return {**conv, "messages": []}

    @router.get("/{conv_id}")
    async def get_conversation(conv_id: str, request: Request) -> dict:
        return await run_in_threadpool(store.get, owner_of(request), conv_id)

    @router.patch("/{conv_id}")
    async def update_conversation(conv_id: str, request: Request) -> dict:
        owner = owner_of(request)
        body = await _json_body(request)
        return await run_in_threadpool(lambda: store.update(owner, conv_id, title=body.get("title"),
                                                            model=body.get("model"),
                                                            settings=body.get("settings")))

    @router.delete("/{conv_id}")
    async def delete_conversation(conv_id: str, request: Request) -> dict:
        await run_in_threadpool(store.delete, owner_of(request), conv_id)
        return {"id": conv_id, "object": "kvserve.conversation.deleted", "deleted": True}

    @router.post("/{conv_id}/messages")
    async def put_messages(conv_id: str, request: Request) -> dict:
        owner = owner_of(request)
        body = await _json_body(request)
        return await run_in_threadpool(lambda: store.put_messages(owner, conv_id, body.get("messages"),
                                                                  start=body.get("start")))

    return router


async def _kvserve_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, KVServeError)
    return JSONResponse(exc.to_dict(), status_code=exc.status)


def mount_webui(app: FastAPI, db_path: pathlib.Path, limits: StoreLimits | None = None,
                store: ConversationStore | None = None) -> None:
    """Serve the chat page at `/`, its assets at `/static/*` and the conversation API, on `store`
    (the server's, from stores/factory.py) or else the SQLite store at `db_path`."""
    if store is None:
        store = ConversationStore(db_path, limits)
    app.state.conversation_store = store

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=_PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.include_router(conversations_router(store))
    # The server registers its own OpenAI-shaped handler for KVServeError; this one only
    # stands in when the page is mounted on a bare app (as in the store's tests).
    if KVServeError not in app.exception_handlers:
        app.add_exception_handler(KVServeError, _kvserve_error)
