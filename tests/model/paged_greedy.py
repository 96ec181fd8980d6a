"""What the fast-path tests (test_shapes.py, test_gemma_fast_path.py) share: the check that a model
runs every layer on the whole-stack C forward, and greedy decoding straight over its paged KV cache,
without the engine, run on the C forward and on the PyTorch reference path to compare the two.
Each test builds its own cache and block tables."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.engine.sampler import greedy_ids
from kvserve.model.attention import AttentionMetadata
from kvserve.model.kernels.backend import KernelBackend


def paged_greedy(model, backend: KernelBackend, prompt: list[int], n: int, kv: list[torch.Tensor],
                 meta: Callable[[int, int], AttentionMetadata],
                 chunks: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill `prompt` (in `chunks`, default one) then decode n tokens greedily on `backend`, with
    `meta(q, s)` the attention metadata of a step of q tokens ending at position s. Returns every
    prompt position's argmax (one chunk only) and the n decoded tokens, and every decode step's
    logits row."""
    base = model.backend
    model.backend = backend
    tokens, logits, done = [], [], 0
    try:
        with torch.inference_mode():
            for size in chunks or [len(prompt)]:
                ids = prompt[done:done + size]
                hidden = model(torch.tensor(ids), torch.arange(done, done + size), meta(size, done + size), kv)
                done += size
                if chunks is None:   # every prompt position's argmax: the model says more than one thing
                    tokens += greedy_ids(model.compute_logits(hidden)).tolist()
            for _ in range(n):
                row = model.compute_logits(hidden[-1:])
                logits.append(row[0])
                tokens.append(int(greedy_ids(row)[0]))
                hidden = model(torch.tensor([tokens[-1]]), torch.tensor([done]), meta(1, done + 1), kv)
                done += 1
    finally:
        model.backend = base
    return tokens, logits


def assert_on_the_fast_path(backend: KernelBackend, model) -> None:
    """No layer of `model` falls back to a slow path, and the start-up line says so."""
    assert backend.slow_paths(model) == []
    assert "every layer and the LM head on the fast path" in backend.describe_model(model)
    ops = model.layer_ops()
    assert ops.packed and ops.max_tokens > 0
