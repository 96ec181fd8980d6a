"""LoRA adapters over HTTP: vLLM's run-time load/unload endpoints and the /v1/models entries.

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

Both need the operator's admin key (`kvserve serve --admin-key`, `--admin-key-file`, or
$KVSERVE_ADMIN_KEY) as `Authorization: Bearer <admin key>`; without one configured they answer
403, so run-time loading is off by default (an adapter path is read from the server's disk). The
API keys of `kvserve keys` cannot load adapters. Wrong admin keys are throttled: past
`ADMIN_FAILURES_PER_MINUTE` failed attempts a minute (server-wide, in the rate limiter's buckets),
every admin call is a 429 until the bucket refills, so the key cannot be guessed at line rate.

A loaded adapter is a model name: requests pick it with "model", and /v1/models lists it with the
base as `parent`. Its scope: everyone's (from --lora, or loaded with no owner), or one key's when
loaded with `"kvserve_owner": "<key name>"`: then only that key lists and uses it (another key
gets the 404 of an unknown model).
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from kvserve.errors import AuthenticationError, KVServeError
from kvserve.server.protocol import read_request

ADMIN_FAILURES_PER_MINUTE = 10
ADMIN_BUCKET = "admin:failed-keys"   # not a key name `kvserve keys` can create (no ':')


class AdminDisabled(KVServeError, status=403, type="permission_error", code="admin_disabled"):
    """Run-time LoRA loading is off: the server has no admin key (HTTP 403)."""


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    kvserve_owner: str | None = None    # the key name the adapter is for (None: every key)


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def _check_admin(state, request: Request) -> None:
    admin = state.settings.admin_key
    if not admin:
        raise AdminDisabled("Run-time LoRA loading is off: start the server with --admin-key (or "
                            "$KVSERVE_ADMIN_KEY) and send that key.")
    state.limiter.refuse_if_empty(ADMIN_BUCKET, ADMIN_FAILURES_PER_MINUTE, "Too many wrong admin keys")
    auth = request.headers.get("authorization", "")
    presented = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    if not presented or not hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), admin.encode()):
        state.limiter.take_one(ADMIN_BUCKET, ADMIN_FAILURES_PER_MINUTE)
        raise AuthenticationError("This endpoint needs the admin key: `Authorization: Bearer <admin key>`.")


def mount_lora(app: FastAPI, state) -> None:

    async def admin_call(request: Request, model: type[BaseModel]) -> tuple:
        """(the validated body, the engine) of an admin call: the key checked first (403, 401)."""
        _check_admin(state, request)
        req = await read_request(request, model, state.settings)
        engine, _ = state.require_engine(None)
        return req, engine

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict:
        req, engine = await admin_call(request, LoadLoRARequest)
        await asyncio.to_thread(engine.add_lora, req.lora_name, req.lora_path)
        if req.kvserve_owner:
            state.pool.lora_owners[req.lora_name] = req.kvserve_owner
        else:
            state.pool.lora_owners.pop(req.lora_name, None)
        return {"object": "lora_adapter", "id": req.lora_name, "status": "loaded"}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> dict:
        req, engine = await admin_call(request, UnloadLoRARequest)
        engine.remove_lora(req.lora_name)
        state.pool.lora_owners.pop(req.lora_name, None)
        return {"object": "lora_adapter", "id": req.lora_name, "status": "unloaded"}
