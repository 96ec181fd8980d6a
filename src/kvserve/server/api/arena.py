"""The arena: two anonymous contestants answer one prompt, the person votes, names are revealed.

    POST /v1/kvserve/arena/battles                    {prompt} → {id}: two contestants drawn at random,
                                                      in random order; who they are stays on the server
    POST /v1/kvserve/arena/battles/{id}/answers/{a|b} the side's answer, streamed as chat-completion SSE
    POST /v1/kvserve/arena/battles/{id}/vote          {winner: a | b | tie | both_bad} → the names
    GET  /v1/kvserve/arena/leaderboard                Bradley-Terry ratings, bootstrap 95% intervals,
                                                      online Elo (stores/arena_ratings.py), over every vote

A contestant is a model plus how it is asked: system prompt and sampling settings. The server
serves one model today, so the default contestants are the served model under three system
prompts and temperatures; `kvserve serve --arena-contestants FILE` (a JSON list of {name, model?,
system?, temperature?, top_p?, max_tokens?}) replaces them. An answer is the contestant's chat
request on the one generation path (plan, lease, run: auth, limits, admission, stages, usage
ledger), rendered by the chat renderer with the model's name replaced by `arena-a` / `arena-b`,
so the stream does not name the contestant's model before the vote. Battles and votes are kept by
the arena store (stores/arena.py, on SQLite or PostgreSQL).
"""

from __future__ import annotations

import json
import pathlib
import secrets
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from kvserve.errors import InvalidRequest
from kvserve.server.api.openai import answer
from kvserve.server.api.openai_wire import OpenAIRenderer
from kvserve.server.api.webui import owner_of
from kvserve.server.gates.limits import read_json
from kvserve.server.protocol import ChatCompletionRequest, validate_body
from kvserve.server.stores.arena import ArenaStore, BattleNotFound
from kvserve.server.stores.arena_ratings import leaderboard

if TYPE_CHECKING:

    from kvserve.server.state import ServerState

MAX_PROMPT_CHARS = 8000
DONE = OpenAIRenderer.done()


@dataclass(frozen=True)
class Contestant:
    name: str
    model: str | None = None          # None: the served model
    system: str | None = None
    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 256

    def chat_body(self, prompt: str) -> dict:
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
                   [{"role": "user", "content": prompt}]
        body = {"messages": messages, "stream": True, "temperature": self.temperature, "top_p": self.top_p,
                "max_tokens": self.max_tokens}
        return body | ({"model": self.model} if self.model else {})


DEFAULT_CONTESTANTS = (
    Contestant("plain"),
    Contestant("concise", system="Answer in one or two short sentences.", temperature=0.3),
    Contestant("storyteller", system="You are a vivid, imaginative writer. Answer with colour and detail.",
               temperature=1.0),
)


def load_contestants(path: str | pathlib.Path | None) -> tuple[Contestant, ...]:
    if path is None:
        return DEFAULT_CONTESTANTS
    try:
        rows = json.loads(pathlib.Path(path).read_text())
        out = tuple(Contestant(**row) for row in rows)
    except (OSError, ValueError, TypeError) as e:
        raise InvalidRequest(f"--arena-contestants {path}: expected a JSON list of {{name, model?, system?, "
                             f"temperature?, top_p?, max_tokens?}} objects ({e})", param="arena_contestants") from None
    if len(out) < 2 or len({c.name for c in out}) != len(out):
        raise InvalidRequest(f"--arena-contestants {path}: give at least two contestants with distinct names",
                             param="arena_contestants")
    return out


def arena_router(gw: ServerState, store: ArenaStore, contestants: tuple[Contestant, ...]) -> APIRouter:
    router = APIRouter(prefix="/v1/kvserve/arena")
    by_name = {c.name: c for c in contestants}
    rng = secrets.SystemRandom()

    @router.post("/battles")
    async def create_battle(request: Request) -> dict:
        owner = owner_of(request)
        prompt = (await read_json(request, gw.settings, off_loop=True)).get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequest("Send {\"prompt\": \"...\"}: the question both contestants answer.", param="prompt")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequest(f"The prompt is longer than {MAX_PROMPT_CHARS} characters.", param="prompt")
        a, b = rng.sample(contestants, 2)
        battle_id = await run_in_threadpool(store.create, owner, prompt, a.name, b.name)
        return {"id": battle_id, "object": "kvserve.arena.battle", "sides": ["a", "b"]}

    @router.post("/battles/{battle_id}/answers/{side}")
    async def answer_side(battle_id: str, side: str, request: Request) -> Response:
        if side not in ("a", "b"):
            raise InvalidRequest("side is a or b", param="side")
        battle = await run_in_threadpool(store.get, owner_of(request), battle_id)
        if battle["winner"] is not None:
            raise InvalidRequest("This battle is over; start a new one.", param="id", code="already_voted")
        contestant = by_name.get(battle[f"model_{side}"])
        if contestant is None:
            raise BattleNotFound("This battle's contestant is no longer configured; start a new one.", param="id")
        req = validate_body(contestant.chat_body(battle["prompt"]), ChatCompletionRequest)
        async def answered() -> None:   # the side counts as answered once its answer succeeded
            await run_in_threadpool(store.answered, battle_id, side)

        return await answer(gw, request, req, "chat", model_alias=f"arena-{side}", on_answered=answered)

    @router.post("/battles/{battle_id}/vote")
    async def vote(battle_id: str, request: Request) -> dict:
        owner = owner_of(request)
        winner = (await read_json(request, gw.settings, off_loop=True)).get("winner")
        battle = await run_in_threadpool(store.vote, owner, battle_id, winner)
        return {"id": battle_id, "object": "kvserve.arena.vote", "winner": winner,
                "model_a": battle["model_a"], "model_b": battle["model_b"]}

    @router.get("/leaderboard")
    async def get_leaderboard() -> dict:
        votes = await run_in_threadpool(store.votes)
        rows = await run_in_threadpool(leaderboard, votes)
        return {"object": "list", "votes": len(votes), "data": rows,
                "contestants": [asdict(c) for c in contestants]}

    return router


def mount_arena(app: FastAPI, gw: ServerState, contestants_file: str | None = None,
                store: ArenaStore | None = None) -> ArenaStore:
    """The arena's routes on `store` (the server's, from stores/factory.py), else the SQLite store in the
    server's database file."""
    if store is None:
        store = ArenaStore(gw.settings.db_path, gw.settings.quota("arena"))
    app.state.arena_store = store
    app.include_router(arena_router(gw, store, load_contestants(contestants_file)))
    return store
