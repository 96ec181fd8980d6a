"""Suite-wide: how `make test` splits the suite between two pytest-xdist workers (`-n 2 --dist loadgroup`).

A test file runs whole on one worker, so its module-scoped servers and models start once. Files
that share an expensive session fixture go to one worker together, so it is built once, not once
per worker: the engine's Ray cluster, the hardened model server, the pretrained nano model of the
training tests. Tests that compare latencies (a bystander within 2x of its unloaded time) are
marked `serial` and run after, in a pass of their own: beside another worker their baseline and
their loaded run would not see the same machine.

The two workers take the work units (a file, or a group) longest first, so that no long unit starts
last and leaves the other worker idle (xdist's own order is by number of tests: a file of one
3-minute test went last). A unit's length is what the last `-n` run measured (the controller keeps
each unit's seconds in the pytest cache, `kvserve/unit-seconds`), else `UNIT_SECONDS_SEEN` (a run
of the whole suite), else its number of tests times `SECONDS_PER_TEST`.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
from collections import defaultdict

import pytest

# session fixture -> the one worker that builds it (an xdist group)
SHARED_SESSION_FIXTURES = {"ray_cluster": "ray", "hardened_server": "hardened", "base_run": "train-base"}

UNIT_SECONDS_KEY = "kvserve/unit-seconds"
SECONDS_PER_TEST = 0.5        # a test outside the slowest 60 of a whole run (2,498 s for 2,488 tests)
# {unit: seconds} of the units of 15 s or more in a whole single-process run (November 28, 2026: its
# slowest 60 durations, and SECONDS_PER_TEST for each other test of the unit)
UNIT_SECONDS_SEEN = pathlib.Path(__file__).with_name("unit_seconds.json")


def work_unit(nodeid: str) -> str:
    """The scheduling unit of a test: its xdist group (`...@group`), else its file."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.split("@")[-1]
    return nodeid.split("::", 1)[0]


def known_unit_seconds(config) -> dict[str, float]:
    seen = json.loads(UNIT_SECONDS_SEEN.read_text()) if UNIT_SECONDS_SEEN.exists() else {}
    cache = getattr(config, "cache", None)
    return seen | (cache.get(UNIT_SECONDS_KEY, {}) if cache is not None else {})


_unit_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    """On the xdist controller: each unit's seconds (setup, call and teardown of its tests)."""
    _unit_seconds[work_unit(report.nodeid)] += report.duration


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput") or config.getoption("dist", "no") != "loadgroup":
        return
    if _unit_seconds and getattr(config, "cache", None) is not None:
        config.cache.set(UNIT_SECONDS_KEY, config.cache.get(UNIT_SECONDS_KEY, {}) | dict(_unit_seconds))


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
                return work_unit(nodeid)

            def _assign_work_unit(self, node) -> None:
                """Before the first unit goes out (the queue is built): the queue, longest first."""
                if not getattr(self, "_longest_first", False):
                    seconds = known_unit_seconds(config)
                    units = sorted(self.workqueue.items(),
                                   key=lambda u: -seconds.get(u[0], len(u[1]) * SECONDS_PER_TEST))
                    self.workqueue.clear()
                    self.workqueue.update(units)
                    self._longest_first = True
                super()._assign_work_unit(node)

        return FileOrGroupScheduling(config, log)
