"""The gateway's one door to a model's EngineClient: every call a generation makes on the engine
(tokenizer and window, KV capacity, grammar compilation, generate, abort) goes through
`ModelHandle`, so the gateway never reaches into engine internals elsewhere."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from kvserve.server.state import ServerState


@dataclass(frozen=True)
class ModelHandle:
    """One served model as a generation sees it: its engine client, served name and price."""

    client: Any                      # kvserve.engine.client.EngineClient (or its LoRA view)
    name: str
    cost_per_token: float | None = None

    @classmethod
    def resolve(cls, gw: ServerState, requested: str | None, caller: str | None = None) -> ModelHandle:
        """The model a request names (the pool's `resolve`: 404 unknown or another key's adapter,
        503 still loading)."""
        client, name = gw.pool.resolve(requested, caller)
        return cls(client, name, gw.pool.entry(name).cost_per_token)

    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def block_size(self) -> int:
        return self.client.block_size

    def kv_capacity_tokens(self) -> int | None:
        """How many tokens the KV cache holds at once (None: unknown, no limit checked)."""
        blocks = self.client.stats().get("kv_blocks_total")
        return blocks * self.block_size if blocks else None

    async def prepare_grammar(self, structured: StructuredOutputsParams, param: str) -> None:
        """Compile (and cache) a grammar off the event loop, with the compiler's time limit (400
        naming `param` when it is refused)."""
        await self.client.inputs.grammar_compiler().prepare_async(structured, param)

    def generate(self, token_ids: list[int], params: SamplingParams, request_id: str, *, priority: int,
                 cache_salt: str | None, prompt: str | None, cache_salt_from: int,
                 draft_token_ids: list[int] | None = None,
                 draft_min_logprob: float | None = None) -> AsyncIterator[RequestOutput]:
        return self.client.generate(token_ids, params, request_id, priority=priority, cache_salt=cache_salt,
                                    prompt=prompt, cache_salt_from=cache_salt_from, draft_token_ids=draft_token_ids,
                                    draft_min_logprob=draft_min_logprob)

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)
