"""The routing step's optional parts, held together for the app: the sentence encoder behind
/v1/embeddings, the semantic cache (semantic_cache.py) and the model router (router.py).

`ServerFeatures.create(state)` builds them from the settings; the generation handler asks
`route(...)` which model serves a request and `cache` whether an answer is already stored.
"""

from __future__ import annotations

from fastapi import FastAPI

from kvserve.server.embeddings import Embedder, mount_embeddings


class ServerFeatures:
    def __init__(self, state, embedder: Embedder):
        self.state = state
        self.embedder = embedder

    @classmethod
    def create(cls, state) -> ServerFeatures:
        return cls(state, Embedder(state.metrics.registry))

    def mount(self, app: FastAPI) -> None:
        mount_embeddings(app, self.state, self.embedder)

    def model_cards(self, created: int) -> list[dict]:
        return [self.embedder.card(created)]

    def close(self) -> None:
        pass
