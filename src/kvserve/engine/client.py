"""EngineClient: what the server holds to talk to an engine (provisional: in-process only)."""

from __future__ import annotations


def make_engine_client(model: str | None = None, *, engine_process: bool = False, weight_format: str = "auto",
                       **engine_kwargs):
    """Load `model` and return a client for it (blocking: call it from a thread)."""
    from kvserve.engine.async_engine import AsyncEngine

    return AsyncEngine.from_model(model, weight_format=weight_format, **engine_kwargs)
