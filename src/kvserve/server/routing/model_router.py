"""The model router: requests for the model "auto" (or the configured name) go to the cheapest
model predicted good enough for them.

A light classifier (train/router_training.py: logistic regression over a sentence feature of the last user
message, trained by `kvserve train router`, or at startup on the built-in labelled prompts when no
file is given) predicts the prompt's difficulty level. The feature is all-MiniLM-L6-v2's hidden
states after its first `layers` layers (the classifier file's "layers", default 2 of 6; absent:
the full embedding), mean-pooled: a third of the encoder's work when the router alone needs it,
and a tap on the same forward when the semantic cache embeds the query too. Every served model has a
level it handles (`router.levels`, default: the cheapest model 0, the others 1) and a price
(`cost_per_1k_tokens`). The decision is the cheapest model whose level covers the prediction;
under load (the admission ladder's first rung) it is the cheapest model outright. The decision
goes into the response's `model`, the trace (`router`: probabilities, reason, time), the usage's
cost and `kvserve:router_decisions_total`.

Config (the `router` object of `--models-config`): {"name": "auto", "classifier": "router.json",
"levels": {"small": 0, "large": 1}, "threshold": 0.5}.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from pathlib import Path

import numpy as np

from kvserve.errors import InvalidRequest
from kvserve.semantic_text import normalize
from kvserve.server.routing.embedder import Embedder, QueryEmbedding
from kvserve.server.routing.pool import ModelPool
from kvserve.train.router_training import labelled_prompts, train_router


def _last_user_text(req, kind: str) -> str:
    if kind == "chat":
        for m in reversed(req.messages):
            if m.role == "user":
                return m.text() if hasattr(m, "text") else str(m.content or "")
        return ""
    p = req.prompt
    return p if isinstance(p, str) else (p[0] if p and isinstance(p[0], str) else "")


class ModelRouter:
    """The "auto" model: a classifier over the query's embedding picks the cheapest model able to answer."""

    def __init__(self, name: str, pool: ModelPool, embedder: Embedder | None, classifier: dict | None,
                 levels: dict[str, int] | None,
                 threshold: float = 0.5, classifier_path: str | None = None):
        self.name = name
        self.pool = pool
        self.embedder = embedder
        self.classifier = classifier
        self.classifier_path = classifier_path
        self.levels = levels
        self.threshold = threshold
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: dict, pool: ModelPool, embedder: Embedder | None) -> ModelRouter:
        if not isinstance(cfg, dict):
            raise InvalidRequest("router: expected an object {name, classifier, levels, threshold}", param="router")
        unknown = set(cfg) - {"name", "classifier", "levels", "threshold"}
        if unknown:
            raise InvalidRequest(f"router: unknown option(s) {sorted(unknown)}", param="router")
        name = cfg.get("name", "auto")
        if name in pool.names():
            raise InvalidRequest(f"router: the name {name!r} is already a model's", param="router")
        clf = None
        if cfg.get("classifier"):
            try:
                clf = json.loads(Path(cfg["classifier"]).read_text())
            except (OSError, ValueError) as e:
                raise InvalidRequest(f"router: cannot read classifier {cfg['classifier']}: {e}",
                                     param="router") from None
            layers = clf.get("layers") if isinstance(clf, dict) else "?"
            if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool) or layers < 0):
                raise InvalidRequest(f"router: classifier {cfg['classifier']}: \"layers\" must be a whole "
                                     f"number of encoder layers, not {layers!r}", param="router")
            if layers is not None and layers > embedder.layers():
                raise InvalidRequest(f"router: classifier {cfg['classifier']}: \"layers\" is {layers}, but the "
                                     f"sentence encoder has {embedder.layers()}", param="router")
        return cls(name, pool, embedder, clf, cfg.get("levels"), float(cfg.get("threshold", 0.5)),
                   cfg.get("classifier"))

    def load(self) -> None:
        """Train on the built-in labelled prompts when no classifier file was given (a few seconds)."""
        with self._lock:
            if self.classifier is None:
                self.classifier = train_router(labelled_prompts(), self.embedder.get())

    def card(self, created: int) -> dict:
        return {"id": self.name, "object": "model", "created": created, "owned_by": "kvserve",
                "kvserve_kind": "router", "routes_to": [e.name for e in self._by_cost()]}

    def _by_cost(self) -> list:
        return sorted(self.pool.loaded(), key=lambda e: e.spec.cost_per_1k_tokens)

    def _level(self, entry, rank: int) -> int:
        if self.levels and entry.name in self.levels:
            return int(self.levels[entry.name])
        return 0 if rank == 0 else 1

    @property
    def depth(self) -> int | None:
        """The encoder depth of the classifier's feature (None: the full embedding)."""
        return None if self.classifier is None else self.classifier.get("layers")

    def predict(self, vector: np.ndarray) -> tuple[int, list[float]]:
        """(predicted level, class probabilities)."""
        clf = self.classifier
        W, b = np.asarray(clf["coef"], dtype=np.float32), np.asarray(clf["intercept"], dtype=np.float32)
        z = W @ vector + b
        if len(clf["classes"]) == 2:     # binary: one row, P(class 1)
            p1 = 1.0 / (1.0 + math.exp(-float(z[0])))
            probs = [1.0 - p1, p1]
            return (clf["classes"][1] if p1 >= self.threshold else clf["classes"][0]), probs
        e = np.exp(z - z.max())
        probs = (e / e.sum()).tolist()
        return int(clf["classes"][int(np.argmax(probs))]), probs

    def query_text(self, req, kind: str) -> str:
        """What the classifier embeds: the last user message, normalized as the semantic cache
        normalizes it (so one embedding serves both), or raw for a classifier trained on raw text."""
        text = _last_user_text(req, kind)[:4000]
        if self.classifier is None or self.classifier.get("normalized"):
            text = normalize(text)
        return text or " "

    async def choose(self, req, kind: str, overloaded: bool = False,
                     query: QueryEmbedding | None = None) -> dict:
        t0 = time.perf_counter()
        ranked = self._by_cost()
        if not ranked:
            return {"model": None, "reason": "loading"}
        if overloaded:
            return {"model": ranked[0].name, "reason": "overload", "router_ms": 0.0}
        if self.classifier is None:
            await asyncio.to_thread(self.load)
        if query is None:
            query = QueryEmbedding(self.query_text(req, kind))
        vector = await query.get(self.embedder, "router", self.depth)
        t1 = time.perf_counter()
        level, probs = self.predict(vector)
        chosen = next((e for i, e in enumerate(ranked) if self._level(e, i) >= level), ranked[-1])
        t2 = time.perf_counter()
        # router_ms: all of it; embed_ms of it is the encoder's forward (the whole depth when the
        # semantic cache reuses it, embedder.QueryEmbedding); classify_ms is the router's own work.
        return {"model": chosen.name, "reason": "classifier", "level": level, "layers": self.depth,
                "probabilities": [round(p, 4) for p in probs], "router_ms": round((t2 - t0) * 1000, 2),
                "embed_ms": round((t1 - t0) * 1000, 2), "classify_ms": round((t2 - t1) * 1000, 3)}
