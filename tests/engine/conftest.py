"""Fixtures shared by the engine tests:

* `ray_cluster`: a local Ray cluster shared by the Ray tests of this package (started at first use,
  stopped at the end of the session), so each test module does not pay for its own.
* `loaded`: the default model in its default weight format (packed GGUF, C kernels), loaded once
  per module; the module is skipped where that backend is not batch-invariant. A module that needs
  another format (fp32, say) defines its own `loaded`, which pytest uses instead of this one."""

from __future__ import annotations

import pytest

from kvserve.model.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    lm = load_model(None)
    if not lm.backend.batch_invariant:
        pytest.skip(f"backend is not batch-invariant here: {lm.backend.describe()}")
    return lm
