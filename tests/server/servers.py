"""The servers the server tests start on 127.0.0.1 (the fixtures that start them are in conftest.py).

`InProcessServer` runs the app in-process under uvicorn; `ModelServer` launches
`python -m kvserve.server serve` as a subprocess with the real default model. Test modules import
these from here (`from servers import ...`): a module named `conftest` is ambiguous when several
test folders run in one pytest process.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
from typing import Self

import httpx
import uvicorn

from kvserve.server.app import create_app
from kvserve.server.settings import ServerSettings

REPO = pathlib.Path(__file__).resolve().parents[2]
ENGINE_CLIENTS = ("inproc", "process")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessServer:
    def __init__(self, settings: ServerSettings):
        self.app = create_app(None, settings)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def state(self):
        return self.app.state.server

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)



class ModelServer:
    """`python -m kvserve.server serve` in a subprocess, with the real default model."""

    def __init__(self, data_dir: pathlib.Path, *args: str, engine: str = "inproc"):
        assert engine in ENGINE_CLIENTS, engine
        self.data_dir = data_dir
        self.engine = engine
        self.args = args + (("--engine-process",) if engine == "process" else ())
        if "--semantic-cache" not in args:   # tests of other features expect every request to run the model
            self.args += ("--semantic-cache", "off")
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir / f"server-{self.port}.log"

    def start(self, timeout: float = 600, *, wait_for_model: bool = True) -> ModelServer:
        """Start the server and wait until /health is 200 (or, without `wait_for_model`, until it
        answers at all: the gateway is up and the model still loading)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.server", "serve", "--port", str(self.port),
             "--data-dir", str(self.data_dir), *self.args],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(self.base_url + "/health", timeout=2)
                if r.status_code == 200 or not wait_for_model:
                    return self
                if r.json().get("status") == "error":   # the model failed to load, or the engine died
                    raise RuntimeError(f"server unhealthy: {r.text}: {self.log_path.read_text()[-3000:]}")
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy in {timeout}s: {self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        if getattr(self, "_log", None):
            self._log.close()

    def access_log(self) -> list[str]:
        return [line for line in self.log_path.read_text().splitlines() if line.startswith('{"ts"')]


HARDENED_SHARED_PROMPT = (
    "You are the help desk of the Example Library. Answer in one short sentence, politely, and never "
    "make up opening hours, fees or titles that are not in the catalogue.")
