"""The overload ladder's first rung: past `ladder_route_cheaper_at` waiting requests the router
sends "auto" requests to the cheapest model (before max_tokens is capped at `ladder_cap_at`)."""

from __future__ import annotations

import asyncio

from kvserve.server.gates.admission import Admission
from kvserve.server.routing.model_router import ModelRouter
from kvserve.server.routing.pool import ModelPool, ModelSpec
from kvserve.server.settings import ServerSettings


def test_route_cheaper_comes_before_the_max_tokens_cap(tmp_path):
    s = ServerSettings(load_model=False, data_dir=tmp_path, max_running=1, ladder_route_cheaper_at=1, ladder_cap_at=2)
    adm = Admission(s)

    async def run() -> tuple[bool, bool, int | None]:
        first = await adm.acquire(0)
        before = adm.prefers_cheaper("paid")
        waiter = asyncio.ensure_future(adm.acquire(0))
        await asyncio.sleep(0.01)
        during = adm.prefers_cheaper("paid"), adm.check("paid").max_tokens_cap
        first.release()
        (await waiter).release()
        return before, *during

    before, cheaper, cap = asyncio.run(run())
    assert before is False and cheaper is True and cap is None   # one waiting: cheaper model, no cap yet
    assert ServerSettings().ladder_route_cheaper_at < ServerSettings().ladder_cap_at


def test_router_under_load_picks_the_cheapest_without_the_classifier(tmp_path):
    s = ServerSettings(load_model=False, data_dir=tmp_path)
    pool = ModelPool(s, [ModelSpec("big", "b", cost_per_1k_tokens=3.0), ModelSpec("small", "s", cost_per_1k_tokens=0.1)])
    for e in pool.entries:      # the router reads names and prices of loaded entries only
        e.engine = e.name
    r = ModelRouter("auto", pool, embedder=None, classifier=None, levels=None)
    decision = asyncio.run(r.choose(None, "chat", overloaded=True))
    assert decision == {"model": "small", "reason": "overload", "router_ms": 0.0}
    assert r.card(0)["routes_to"] == ["small", "big"]
