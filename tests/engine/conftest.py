"""A local Ray cluster shared by the Ray tests of this package (started at first use, stopped at
the end of the session), so each test module does not pay for its own."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False)
    yield ray
    ray.shutdown()
