"""Which model object an engine runs: the loaded model, or rank 0 of a tensor-parallel group.

`load_engine_model` is what every engine host calls (the in-process client, the engine process,
a Ray replica): with `tensor_parallel_size` > 1 the layers are split over that many processes
(model/parallel.py) and the EngineCore drives rank 0's model like any other; the other ranks
follow each step's broadcast. Nothing above the model changes.
"""

from __future__ import annotations

import dataclasses

from kvserve.engine.config import EngineConfig
from kvserve.model.loader import load_model
from kvserve.model.numerics import init_math_libraries


def load_engine_model(model: str | None, weight_format: str, cfg: EngineConfig):
    """A LoadedModel whose `model` the EngineCore runs (blocking)."""
    init_math_libraries()
    if cfg.tensor_parallel_size > 1:
        from kvserve.model.parallel import launch

        loaded, rank0 = launch(model, cfg.tensor_parallel_size, block_size=cfg.block_size,
                               num_threads=cfg.num_threads)
        return dataclasses.replace(loaded, model=rank0)
    return load_model(model, weight_format=weight_format)
