"""Helpers for the browser tests (tests/web): a real `kvserve serve` process, page helpers, metrics.
The `browser` fixture and the skip without Chromium or Playwright are in conftest.py."""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = pathlib.Path(__file__).resolve().parents[2] / "test-artifacts"

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def run_server(data_dir: pathlib.Path, *extra: str):
    """`kvserve serve` on a free port with the real default model, until healthy; its base URL."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = data_dir / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.server", "serve", "--port", str(port),
                                 "--data-dir", str(data_dir), *extra], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"kvserve serve exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy in time:\n{log_path.read_text()}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_until(page, js: str, timeout: float = 120.0, what: str = ""):
    """Poll a JS expression (page.wait_for_function evaluates strings, which the page's CSP forbids)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = page.evaluate(js)
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or js}")


def open_page(browser, base: str, client: str, *, settings: dict | None = None, bypass_csp: bool = False,
              hash_: str = ""):
    """A fresh browser profile whose page identifies itself as `client` (X-KVServe-Client)."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 900}, bypass_csp=bypass_csp)
    init = f"localStorage.setItem('kvserve.clientId', {json.dumps(client)});"
    if settings:
        init += f"localStorage.setItem('kvserve.settings', {json.dumps(json.dumps(settings))});"
    ctx.add_init_script(init)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: (errors.append(f"dialog: {d.message}"), d.dismiss()))
    page.goto(base + "/" + hash_)
    wait_until(page, "document.documentElement.dataset.ready === '1'", 30, "page ready")
    return page, errors


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    m = re.search(rf"^kvserve:{name}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def set_settings_via_dialog(page, *, max_tokens: int, temperature: float) -> None:
    page.click("#open-settings")
    page.fill("#set-max-tokens", str(max_tokens))
    page.fill("#set-temperature", str(temperature))
    page.click("#save-settings")
    wait_until(page, f"JSON.parse(localStorage.getItem('kvserve.settings') || '{{}}').max_tokens === {max_tokens}",
               5, "settings saved")
