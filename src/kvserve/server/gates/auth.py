"""The gateway's outer layer, as raw ASGI: request id, authentication, and the access log.

Auth decides on `scope["path"]`, the path the router will match, exactly as the server received
it (percent-decoded by uvicorn, nothing rebuilt from Host or forwarding headers). Public means an
exact match with a short list, or the `/static/` prefix, which only ever routes to the static
file mount; anything else (`//v1/models`, `/health/../v1/models`, `/v1/models/`, `/%761/models`)
needs a key.

Every authenticated route takes one token from the key's request bucket here (429 when empty),
so /tokenize and the conversation API are limited like generation, and every response to a
limited key carries the `x-ratelimit-*` headers. When a shared store (Redis, PostgreSQL) is
unreachable, auth and the bucket answer 503 with Retry-After (stores/). It also counts, in the
live counters (stores/), the authenticated-route requests let through (`requests`) and those
refused (`rate_limited`, `refused_401`, `refused_503`). With a shared store these checks are
network round trips, so they run in a worker thread rather than on the event loop.

Each request gets a `RequestRecord` (records.py) in `scope["state"]["record"]`: its id, arrival
time and caller (key, name, tier), set before any route runs. Handlers read the caller from it
and attach their own fields to it; the middleware writes it as the access-log line once the
response is done. Routes that only need the caller's name (the web page's conversations) read
`request.state.key_name`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import re
import time
import uuid

from kvserve.errors import AuthenticationError, KVServeError, RateLimitError
from kvserve.server.error_shapes import shape_error
from kvserve.server.gates.ratelimit import RateLimiter
from kvserve.server.records import RequestRecord
from kvserve.server.stores.counters import CounterBackend
from kvserve.server.stores.keys import CLI_KEY_NAME, ApiKey, KeyBackend

access_log = logging.getLogger("kvserve.access")

PUBLIC_PATHS = frozenset({"/health", "/", "/index.html", "/favicon.ico", "/openapi.json"})
PUBLIC_PREFIXES = ("/static/",)
_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
LEGACY_DB_CLI_NAME = "db:api-key"   # a database key named api-key from before the name was reserved
METRICS_PATH = "/metrics"

# Routes that check the admin key themselves (api/lora_admin.py): the gateway lets them through.
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def manages_models(record: RequestRecord) -> bool:
    """Whether a request's caller may act on models other keys share (unload one with keep_alive 0,
    shorten its keep_alive): the server's own --api-key, or anyone on a server without keys."""
    return record.key is None or record.key.name == CLI_KEY_NAME


async def send_error(send, err: KVServeError, headers: list[tuple[bytes, bytes]] | None = None,
                     path: str = "") -> None:
    status, shaped = shape_error(path, err.status, err.to_dict())   # the API's own error shape
    body = json.dumps(shaped).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())] + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class GatewayMiddleware:
    def __init__(self, app, keystore: KeyBackend, api_key: str | None = None, limiter: RateLimiter | None = None,
                 counters: CounterBackend | None = None, metrics_key: str | None = None):
        self.app = app
        self.metrics_key = metrics_key   # set: /metrics needs this key and no other
        self.keystore = keystore
        self.api_key = api_key
        self.limiter = limiter
        self.counters = counters
        # A shared store is a network round trip: run the gate in a worker thread, off the event loop.
        self.offload = any(getattr(x, "remote", False) for x in (keystore, limiter, counters))

    def authenticate(self, scope: dict) -> ApiKey | None:
        """The caller's key, None when auth is off; raises AuthenticationError."""
        if self.api_key is None and not self.keystore.auth_required():
            return None
        auth = _header(scope, b"authorization")
        if auth and auth[:7].lower() == "bearer " and auth[7:].strip():
            presented = auth[7:].strip()
        elif (x_api_key := (_header(scope, b"x-api-key") or "").strip()):   # Anthropic's clients send this
            presented = x_api_key
        else:
            raise AuthenticationError("Missing API key. Send it as `Authorization: Bearer <key>` (or "
                                      "`x-api-key: <key>`); create one with `kvserve keys create --name NAME`.")
        key = self.keystore.lookup(presented)
        if key is not None and key.name == CLI_KEY_NAME:   # never the --api-key's buckets, ledger or stores
            key = dataclasses.replace(key, name=LEGACY_DB_CLI_NAME)
        if self.api_key is not None and hmac.compare_digest(
                presented.encode("utf-8", "surrogateescape"), self.api_key.encode()):
            key = ApiKey(name=CLI_KEY_NAME, tier="paid")
        if key is None:
            raise AuthenticationError("Invalid or revoked API key. Check the key, or create a new one "
                                      "with `kvserve keys create --name NAME`.")
        return key

    def _gate(self, scope: dict, state: dict, record: RequestRecord) -> None:
        """Authenticate, take a token from the key's request bucket, count the request; raises
        the KVServeError to answer with."""
        key = self.authenticate(scope)
        if key is not None:
            record.key, record.key_name, record.key_tier = key, key.name, key.tier
            state["key_name"] = key.name
            if self.limiter is not None:
                self.limiter.acquire_request(key.name, key.rpm)
        self._count("requests")

    def _count(self, name: str) -> None:
        """A live counter (shared by replicas when in Redis); losing one never fails a request."""
        if self.counters is not None:
            try:
                self.counters.incr(name)
            except KVServeError:
                pass

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = _header(scope, b"x-request-id")
        record = RequestRecord(request_id=incoming if incoming and _REQUEST_ID_OK.match(incoming) else uuid.uuid4().hex,
                               t0=time.monotonic(), method=scope.get("method"), path=scope["path"])
        state = scope.setdefault("state", {})
        state.update(record=record, key_name=None)
        rid_header = (b"x-request-id", record.request_id.encode())

        async def send_wrapped(message):
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = dict(message)
                extra = [rid_header]
                key = record.key
                if key is not None and self.limiter is not None and (key.rpm or key.tpm):
                    try:
                        if self.offload:
                            extra += await asyncio.to_thread(self.limiter.headers, key.name, key.rpm, key.tpm)
                        else:
                            extra += self.limiter.headers(key.name, key.rpm, key.tpm)
                    except KVServeError:   # the shared store went away: the answer goes out without them
                        pass
                message["headers"] = list(message.get("headers", [])) + extra
            await send(message)

        try:
            if record.path == METRICS_PATH and self.metrics_key is not None:
                auth = _header(scope, b"authorization") or ""
                if not hmac.compare_digest(auth[7:].strip().encode("utf-8", "surrogateescape"),
                                           self.metrics_key.encode()) or auth[:7].lower() != "bearer ":
                    self._count("refused_401")
                    await send_error(send_wrapped, AuthenticationError(
                        "/metrics needs the metrics key (`kvserve serve --metrics-key`): "
                        "`Authorization: Bearer <metrics key>`."))
                    return
            elif not is_public(record.path) and record.path not in ADMIN_PATHS:   # admin key: the route checks
                try:
                    if self.offload:
                        await asyncio.to_thread(self._gate, scope, state, record)
                    else:
                        self._gate(scope, state, record)
                except KVServeError as err:   # 401, 429, or 503 when a shared store is down
                    self._count("rate_limited" if isinstance(err, RateLimitError) else f"refused_{err.status}")
                    retry_after = getattr(err, "retry_after", None)
                    headers = [] if retry_after is None else [
                        (b"retry-after", str(max(1, int(retry_after + 0.999))).encode()), (b"x-should-retry", b"true")]
                    await send_error(send_wrapped, err, headers, record.path)
                    return
            await self.app(scope, receive, send_wrapped)
        finally:
            access_log.info(record.access_log_line())
