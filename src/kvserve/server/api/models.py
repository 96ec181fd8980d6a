"""The model list, as OpenAI answers it.

    GET /v1/models          every served model, LoRA adapter, the router ("auto") and the encoder
    GET /v1/models/{id}     one of them (404 `model_not_found` otherwise; 503 while loading)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fastapi import FastAPI

if TYPE_CHECKING:
    from kvserve.server.app import ServerState


def mount_models(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def models() -> dict:
        now = int(time.time())
        return {"object": "list", "data": state.pool.cards(now) + state.routing.model_cards(now)}

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> dict:
        now = int(time.time())
        for card in state.routing.model_cards(now) + state.pool.cards(now):   # models, adapters, router
            if card["id"] == model_id:
                return card
        engine, name = state.require_engine(model_id or None)   # the pool's resolve: 404 / 503
        return {"id": name, "object": "model", "created": now, "owned_by": "kvserve",
                "max_model_len": engine.max_model_len}
