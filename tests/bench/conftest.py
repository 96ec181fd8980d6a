"""Fixtures the bench tests share."""

from __future__ import annotations

import pathlib
import tempfile

import pytest


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> pathlib.Path:
    """An empty folder that is the temp dir of this process and of the servers a bench launches
    (TMPDIR): a test checks it is empty again afterwards, so nothing they made was left behind."""
    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path
