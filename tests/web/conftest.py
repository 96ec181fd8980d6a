"""Browser tests: skipped where Debian's Chromium or Playwright is missing; one headless Chromium per
module (`browser`)."""

from __future__ import annotations

import importlib.util
import os

import pytest
from webpage import CHROMIUM

_MISSING = ("needs Debian's chromium (scripts/test-deps.sh installs it)" if not os.path.exists(CHROMIUM) else
            "needs playwright (the test extra)" if importlib.util.find_spec("playwright") is None else None)


def pytest_collection_modifyitems(config, items):
    if _MISSING is None:
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=_MISSING))


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield b
        b.close()
