"""Suite-wide: how `make test` splits the suite between two pytest-xdist workers (`-n 2 --dist loadgroup`).

A test file runs whole on one worker, so its module-scoped servers and models start once. Files
that share an expensive session fixture go to one worker together, so it is built once, not once
per worker: the engine's Ray cluster, the hardened model server, the pretrained nano model of the
training tests. Tests that compare latencies (a bystander within 2x of its unloaded time) are
marked `serial` and run after, in a pass of their own: beside another worker their baseline and
their loaded run would not see the same machine.
"""

from __future__ import annotations

import importlib.util

import pytest

# session fixture -> the one worker that builds it (an xdist group)
SHARED_SESSION_FIXTURES = {"ray_cluster": "ray", "hardened_server": "hardened", "base_run": "train-base"}


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook turns the group marks into node ids
def pytest_collection_modifyitems(config, items):
    group_of_file: dict[str, str] = {}        # a whole file joins the group (its module fixtures start once)
    for item in items:
        for fixture, group in SHARED_SESSION_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()):
                group_of_file.setdefault(item.nodeid.split("::", 1)[0], group)
    for item in items:
        group = group_of_file.get(item.nodeid.split("::", 1)[0])
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


if importlib.util.find_spec("xdist") is not None:
    def pytest_xdist_make_scheduler(config, log):
        """`--dist loadgroup` with a file as the unit: a test without a group goes with its file."""
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadGroupScheduling

        class FileOrGroupScheduling(LoadGroupScheduling):
            def _split_scope(self, nodeid: str) -> str:
                if nodeid.rfind("@") > nodeid.rfind("]"):
                    return nodeid.split("@")[-1]
                return nodeid.split("::", 1)[0]

        return FileOrGroupScheduling(config, log)
