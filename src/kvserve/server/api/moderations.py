"""`POST /v1/moderations` in OpenAI's shape, over the same moderators as the gateway's input gate
and output stage (gates/moderation.py): the caller's policy (key and tier) applies.

    {"input": "text" | ["text", ...] | [{"type": "text", "text": ...}, ...], "model"?: ...}
    -> {"id": "modr-...", "model": ..., "results": [{flagged, categories, category_scores}, ...]}
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request

from kvserve.errors import InvalidRequest
from kvserve.server.gates.limits import read_json

if TYPE_CHECKING:
    from kvserve.server.state import ServerState

MODEL = "kvserve-moderation-1"
MAX_INPUTS = 64       # entries of one /v1/moderations request


def mount_moderations(app: FastAPI, server: ServerState) -> None:
    @app.post("/v1/moderations")
    async def moderations(request: Request) -> dict:
        body = await read_json(request, server.settings)
        if not isinstance(body, dict) or "input" not in body:
            raise InvalidRequest("Missing required parameter: input.", param="input")
        extra = set(body) - {"input", "model"}
        if extra:
            raise InvalidRequest(f"Unrecognized request argument supplied: {min(extra)}.", param=min(extra))
        inp = body["input"]
        if isinstance(inp, str):
            texts = [inp]
        elif isinstance(inp, list) and all(isinstance(x, str) for x in inp) and 0 < len(inp) <= MAX_INPUTS:
            texts = inp
        elif isinstance(inp, list) and all(isinstance(x, dict) and x.get("type") == "text"
                                           and isinstance(x.get("text"), str) for x in inp) and 0 < len(inp) <= MAX_INPUTS:
            texts = [x["text"] for x in inp]
        else:
            raise InvalidRequest(f"input must be a string or a list of 1-{MAX_INPUTS} strings (or text parts).",
                                 param="input")
        record = request.state.record
        mod = server.moderation.moderator(server.moderation.config_for(record))

        def run() -> list[dict]:
            out = []
            for t in texts:
                v = mod.check(t)
                server.moderation.observe("endpoint", v)
                out.append(v.to_openai())
            return out

        results = await asyncio.to_thread(run)
        return {"id": f"modr-{uuid.uuid4().hex}", "model": body.get("model") or MODEL, "results": results}
