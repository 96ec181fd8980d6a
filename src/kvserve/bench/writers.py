"""Conversation writers for `kvserve bench serve --conversation-writers N`: N loops that append a
message (about 2 kB) to one saved conversation each, as fast as the server answers, for as long as
the generation load runs. The numbers show whether the conversation API's writes slow generation
(they must not: appends answer with what was written, parsing and SQLite run off the event loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import httpx

T = TypeVar("T")


async def _writer(client: httpx.AsyncClient, base_url: str, stop: asyncio.Event, counts: list[int]) -> None:
    r = await client.post(base_url + "/v1/kvserve/conversations", json={"title": "bench writer"})
    r.raise_for_status()
    url = f"{base_url}/v1/kvserve/conversations/{r.json()['id']}/messages"
    text = "lorem ipsum dolor sit amet " * 80
    while not stop.is_set():
        r = await client.post(url, json={"messages": [{"role": "user", "content": text}]})
        if r.status_code != 200:     # a quota or a rate limit: stop writing, the load goes on
            return
        counts[0] += 1


async def with_writers(load: Awaitable[T], base_url: str, api_key: str | None, n: int) -> tuple[T, int]:
    """Run `load` with `n` conversation writers alongside; returns its result and the number of writes."""
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {"X-KVServe-Client": "bench-writer-0001"}
    stop, counts = asyncio.Event(), [0]
    async with httpx.AsyncClient(timeout=120, headers=headers) as client:
        tasks = [asyncio.create_task(_writer(client, base_url, stop, counts)) for _ in range(n)]
        try:
            result = await load
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
    return result, counts[0]
