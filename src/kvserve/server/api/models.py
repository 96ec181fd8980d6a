"""The model list, as OpenAI answers it.

    GET /v1/models          every served model, LoRA adapter, the router ("auto") and the encoder;
                            a model on demand (--models-dir) says `kvserve_state`: loaded,
                            loading or unloaded
    GET /v1/models/{id}     one of them (404 `model_not_found` otherwise; 503 while loading)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request

if TYPE_CHECKING:
    from kvserve.server.state import ServerState


def mount_models(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        now = int(time.time())
        caller = request.state.record.key_name   # another key's LoRA adapter is not listed
        return {"object": "list", "data": state.pool.cards(now, caller, unloaded=True) + state.routing.model_cards(now)}

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str, request: Request) -> dict:
        now = int(time.time())
        caller = request.state.record.key_name
        for card in state.routing.model_cards(now) + state.pool.cards(now, caller, unloaded=True):
            if card["id"] == model_id:
                return card
        engine, name = state.require_engine(model_id or None, caller)   # the pool's resolve: 404 / 503
        return {"id": name, "object": "model", "created": now, "owned_by": "kvserve",
                "max_model_len": engine.max_model_len}
